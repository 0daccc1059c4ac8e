"""One typed error hierarchy, mapped to gRPC status codes and HTTP status codes by the adapters."""

from __future__ import annotations

import errno

import grpc

# a disk that filled, a quota, a file size limit: what a write refused for want of room raises (OSError.errno)
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class ServiceError(Exception):
    """Base of every error a server reports to its client on purpose."""

    grpc_code = grpc.StatusCode.INTERNAL
    http_status = 500


class InvalidArgument(ServiceError):
    """The request is malformed; the message names the field and what was expected."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400


class Overloaded(ServiceError):
    """The work queue is full; retry later."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429


class StorageFull(ServiceError):
    """The server's disk (or its quota) is full: what it was asked to write was not written, and nothing changed."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 507


class NotReady(ServiceError):
    """The model is not loaded yet, or the server is shutting down."""

    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503


class DeadlineExceeded(ServiceError):
    """The client's deadline passed before the model worker reached the request; it was not applied."""

    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED
    http_status = 504


class NotFound(ServiceError):
    """The named thing (e.g. a checkpoint) does not exist."""

    grpc_code = grpc.StatusCode.NOT_FOUND
    http_status = 404


class FailedPrecondition(ServiceError):
    """The request is well formed but the server's state or files do not allow it (e.g. a checkpoint that does not
    fit the model, or that cannot be read); nothing was changed."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION
    http_status = 409
