"""Several sessions stepping at once on one daemon (and, under the GPU harness, on one device):
each ends bit-identical to the same session stepped alone, and every answer keeps its own step.
Runs on whatever backend the daemon has ($MUOND_TEST_BACKEND)."""

import threading

import torch

import muond
from helpers import TinyNet, loss_of

SESSIONS = 4
STEPS = 5


# The trainers' own torch work runs one at a time: TinyNet seeds torch's global generator to
# initialize, and a backward in several threads at once may reduce with other chunkings. Only the
# steps run at once.
_TORCH = threading.Lock()


def _train(endpoint, seed, barrier=None):
    with _TORCH:
        model = TinyNet(seed=seed)
    with muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint) as opt:
        for step in range(1, STEPS + 1):
            with _TORCH:
                loss_of(model, step + seed).backward()
            if barrier is not None:
                barrier.wait(timeout=120)  # every session sends this step together
            opt.step()
            assert opt.last_step == step
            opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_sessions_stepping_at_once_match_each_stepped_alone(endpoint):
    alone = [_train(endpoint, 300 + s) for s in range(SESSIONS)]
    together = [None] * SESSIONS
    errors = []
    barrier = threading.Barrier(SESSIONS)

    def run(s):
        try:
            together[s] = _train(endpoint, 300 + s, barrier)
        except BaseException as error:  # noqa: B902 - reported below
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(s,)) for s in range(SESSIONS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for s in range(SESSIONS):
        for name, value in alone[s].items():
            assert torch.equal(together[s][name], value), (s, name)
