"""CUDA parameters: gradients leave the GPU in the wire dtype and updates are copied back into
the CUDA tensors in place. Needs a CUDA device; skips, saying so, without one."""

import pytest
import torch

import muond
from helpers import TinyNet, batch, loss_of, no_gpu, rel_err

pytestmark = pytest.mark.skipif(no_gpu(),
                                reason="no CUDA device visible to torch")


@pytest.mark.parametrize("wire_dtype", ["fp32", "bf16"])
def test_cuda_parameters_are_updated_in_place(endpoint, wire_dtype):
    cpu_model = TinyNet(seed=50)
    gpu_model = TinyNet(seed=50).cuda()
    storage = {n: p.data_ptr() for n, p in gpu_model.named_parameters()}
    gpu = muond.RemoteOptimizer(muond.default_param_groups(gpu_model), endpoint=endpoint,
                                wire_dtype=wire_dtype)
    cpu = muond.RemoteOptimizer(muond.default_param_groups(cpu_model), endpoint=endpoint,
                                wire_dtype=wire_dtype)
    for step in range(1, 6):
        loss_of(cpu_model, step).backward()
        x, y = [t.cuda() for t in batch(step)]
        torch.nn.functional.cross_entropy(gpu_model(x), y).backward()
        for opt in (cpu, gpu):
            opt.step()
            opt.zero_grad()
    gpu.close()
    cpu.close()
    for (name, p), q in zip(gpu_model.named_parameters(), cpu_model.parameters()):
        assert p.is_cuda and p.data_ptr() == storage[name], name
        assert rel_err(p.detach().cpu(), q.detach()) < 1e-3, name
