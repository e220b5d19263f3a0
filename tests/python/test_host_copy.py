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


# The streaming copy (muond/_stream_copy.c). The CMake build that runs these tests builds it, so it
# must be found; installing without a compiler is covered by the fallback test below.

def test_streaming_copy_is_built_and_found():
    from muond.transport import stream_copy
    assert stream_copy.available(), stream_copy.reason()
    assert stream_copy.kind() in ("avx", "sse2", "memcpy")


@pytest.mark.parametrize("sse2_only", [0, 1])
@pytest.mark.parametrize("dst_shift,src_shift", [(0, 0), (1, 0), (0, 3), (5, 7), (7, 1)])
def test_streaming_copy_equals_copy_at_any_alignment_and_length(dst_shift, src_shift, sse2_only, monkeypatch):
    # Shifts in elements of 2 bytes move either side off every 16/32-byte boundary; the lengths
    # cover an empty copy, shorter than one aligned head, and every remainder of a 128-byte block.
    # Both store widths run here (MUOND_STREAM_COPY=sse2 sets the same flag).
    from muond.transport import stream_copy
    assert stream_copy.available(), stream_copy.reason()
    monkeypatch.setattr(stream_copy, "_sse2_only", sse2_only)
    torch.manual_seed(5)
    base_src = torch.randn(5000).to(torch.bfloat16)
    for length in (0, 1, 7, 15, 16, 17, 63, 64, 65, 127, 129, 1000, 4093):
        base_dst = torch.zeros(5000, dtype=torch.bfloat16)
        src = base_src[src_shift:src_shift + length]
        dst = base_dst[dst_shift:dst_shift + length]
        stream_copy.copy(dst, src)
        assert torch.equal(dst, src)
        # Nothing outside the destination is written.
        assert not base_dst[:dst_shift].any() and not base_dst[dst_shift + length:].any()


def test_streaming_copy_refuses_what_it_cannot_copy():
    from muond.transport import stream_copy
    with pytest.raises(ValueError):
        stream_copy.copy(torch.empty(10), torch.empty(10, dtype=torch.float64))
    with pytest.raises(ValueError):
        stream_copy.copy(torch.empty(10, 10), torch.empty(10, 10).t())
    with pytest.raises(ValueError):
        stream_copy.copy(torch.empty(10), torch.empty(11))


def test_streamed_split_copies_equal_copy(split, monkeypatch):
    monkeypatch.setattr(host_copy, "STREAMING_BYTES", 0)
    calls = []
    real = host_copy.stream_copy.copy
    monkeypatch.setattr(host_copy.stream_copy, "copy", lambda d, s: (calls.append(d.numel()), real(d, s)))
    torch.manual_seed(4)
    sources = [torch.randn(12_345), torch.randn(7, 1000), torch.randn(40, 50).t()]
    dests = [torch.empty(s.shape) for s in sources]
    dests.append(torch.empty(3000, dtype=torch.float16))  # another dtype: copy_ converts
    sources.append(torch.randn(3000))
    host_copy.copy_all(list(zip(dests, sources)))
    for got, want in zip(dests, sources):
        assert torch.equal(got, want.to(got.dtype))
    assert sum(calls) == 12_345 + 7000  # the two contiguous same-dtype pairs, in pieces


@pytest.mark.parametrize("setting,kind", [("sse2", "sse2"), ("fast", "")])
def test_stream_copy_setting(setting, kind, tmp_path):
    import os
    import subprocess
    import sys
    script = ("from muond.transport import stream_copy\n"
              "print(stream_copy.kind() or '-', stream_copy.reason() or '-')\n")
    out = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, MUOND_STREAM_COPY=setting),
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    got_kind, reason = out.stdout.split(" ", 1)
    if kind:
        assert got_kind in (kind, "memcpy") and reason.strip() == "-"  # memcpy: not x86-64
    else:
        assert got_kind == "-" and "MUOND_STREAM_COPY='fast' is none of 0, 1, sse2" in reason


def test_without_the_streaming_copy_copies_fall_back_to_copy(tmp_path):
    # A fresh interpreter with MUOND_STREAM_COPY=0 stands for an install without the library.
    import os
    import subprocess
    import sys
    script = ("import torch\n"
              "from muond.transport import host_copy, stream_copy\n"
              "assert not stream_copy.available() and 'MUOND_STREAM_COPY=0' in stream_copy.reason()\n"
              "src = torch.randn(5 << 20); dst = torch.empty(5 << 20)\n"
              "host_copy.copy_all([(dst, src)])\n"
              "assert torch.equal(dst, src)\n"
              "print('ok')\n")
    env = dict(os.environ, MUOND_STREAM_COPY="0")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok"]
