"""The critic server: value inference and critic training over gRPC, optionally serving the reward model too."""
