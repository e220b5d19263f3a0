"""``host_copy.copy_all``: large host copies split over threads copy exactly what ``copy_`` does,
into parameters that require gradients too, and report a failure; small ones and device ones stay
on the calling thread. The split is forced here (small pieces, three threads), whatever the cores."""

import pytest
import torch

from muond.transport import host_copy


@pytest.fixture
def split(monkeypatch):
    monkeypatch.setattr(host_copy, "MIN_PIECE", 1000)
    monkeypatch.setattr(host_copy, "threads", lambda: 3)


def test_split_copies_equal_copy(split):
    torch.manual_seed(3)
    sources = [torch.randn(12_345), torch.randn(7, 1000), torch.randn(10), torch.randn(40, 50).t()]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        dests = [torch.empty(s.shape, dtype=dtype) for s in sources]
        expected = [torch.empty(s.shape, dtype=dtype).copy_(s) for s in sources]
        host_copy.copy_all(list(zip(dests, sources)))
        for got, want in zip(dests, expected):
            assert torch.equal(got, want)


def test_parameters_are_copied_into_without_grad(split):
    param = torch.nn.Parameter(torch.zeros(5000))
    values = torch.arange(5000, dtype=torch.float32)
    host_copy.copy_all([(param, values)])
    assert torch.equal(param.detach(), values)
    assert param.grad_fn is None and param.requires_grad


def test_a_failed_copy_is_raised(split):
    with pytest.raises(RuntimeError):
        host_copy.copy_all([(torch.empty(4000), torch.empty(4000)), (torch.empty(3), torch.empty(4))])


def test_threads_leave_torch_settings_alone():
    before = torch.get_num_threads()
    assert host_copy.threads() >= 1
    host_copy.copy_all([(torch.empty(3 << 20), torch.ones(3 << 20))])
    assert torch.get_num_threads() == before
