"""What the DiLoCo tests share: the workers' seeds, batch sizes and inner AdamW, one inner step of
worker r on its own data, and fresh session ids (test_diloco.py, test_diloco_failures.py)."""

import uuid

import grpc
import torch.nn.functional as F

import muond

from helpers import batch

SEED = 70
SIZES = (8, 16, 24)             # worker r's batch size, and the tokens of each of its steps
INNER = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
# TinyNet's parameters split in two by the documented rule (the middle of down.weight lies past
# half of all elements, so it opens fragment 1).
TWO_FRAGMENTS = [["emb.weight", "up.weight", "up.bias", "norm.weight", "norm.bias"],
                 ["down.weight", "down.bias", "head.weight"]]


def inner_loss(model, rank: int, t: int):
    x, y = batch(100 * rank + t, size=SIZES[rank])  # each worker trains on its own data
    return F.cross_entropy(model(x), y)


def inner_step(model, inner, rank: int, t: int) -> None:
    inner.zero_grad()
    inner_loss(model, rank, t).backward()


def session_name() -> str:
    return f"diloco-{uuid.uuid4().hex[:12]}"


def end_session(endpoint: str, session: str) -> None:
    """Ends a session the workers kept; one never opened (a worker failed first) is fine."""
    conn = muond.Connection(endpoint)
    try:
        conn.close_session(session)
    except muond.MuondError as err:
        if err.code != grpc.StatusCode.NOT_FOUND:
            raise
    finally:
        conn.close()
