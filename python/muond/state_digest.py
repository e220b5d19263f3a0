"""``StateDigest``: the digest of a session's whole state — its step, loss scaler, and every
parameter's step count, master and optimizer slots, hashed by the daemon in a canonical format
(docs/operations.md, "Proving a resume continued the same model"). Equal digests mean equal states,
bit for bit; a resumed run that shows the digest its checkpoint had continued the same model.

A session spread over several daemons (docs/sharding.md) combines its shards' digests in shard
order: SHA-256 of ``"muond-sharded-state-v1\\n"`` followed by each shard's hex digest and ``"\\n"``;
every shard must be at the same step. Immutable values and pure functions."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Sequence, Tuple

import grpc

from .errors import MuondError

SHARDED_FORMAT = "muond-sharded-state-v1"


@dataclass(frozen=True)
class StateDigest:
    """A session's state digest: ``digest`` (lowercase hex) of ``algorithm`` over the state at
    ``step``, in the canonical ``format``; ``num_tensors`` masters and slots, ``num_bytes`` of
    stored bytes. A combined digest lists its shards' digests in ``shards``."""
    step: int
    algorithm: str
    digest: str
    format: str
    num_tensors: int
    num_bytes: int
    shards: Tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"step {self.step} {self.algorithm}:{self.digest}"

    @classmethod
    def from_proto(cls, message: Any) -> "StateDigest":
        return cls(step=int(message.step), algorithm=message.algorithm, digest=message.digest,
                   format=message.format, num_tensors=int(message.num_tensors),
                   num_bytes=int(message.num_bytes))


def combine(shards: Sequence[StateDigest], endpoints: Sequence[str] = ()) -> StateDigest:
    """The digest of a session from its shards' digests, in shard order (the rule above); the one
    shard's own digest for a session on one daemon. ``MuondError(FAILED_PRECONDITION)`` when the
    shards are at different steps."""
    if len(shards) == 1:
        return shards[0]
    steps = {shard.step for shard in shards}
    if len(steps) > 1:
        where = ", ".join(f"shard {k}{f' ({endpoints[k]})' if k < len(endpoints) else ''} at step "
                          f"{shard.step}" for k, shard in enumerate(shards))
        raise MuondError(grpc.StatusCode.FAILED_PRECONDITION,
                         f"the shards' states are at different steps ({where}): restore every "
                         f"shard to one step before comparing digests", "GetStateDigest")
    text = SHARDED_FORMAT + "\n" + "".join(shard.digest + "\n" for shard in shards)
    return StateDigest(step=shards[0].step, algorithm=shards[0].algorithm,
                       digest=hashlib.sha256(text.encode()).hexdigest(), format=SHARDED_FORMAT,
                       num_tensors=sum(s.num_tensors for s in shards),
                       num_bytes=sum(s.num_bytes for s in shards),
                       shards=tuple(s.digest for s in shards))
