"""The reward server: one reward per sample from a learned reward model or a rule-based scorer, over gRPC
and OpenRLHF's remote reward protocol (`POST /get_reward`)."""
