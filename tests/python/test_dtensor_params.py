"""How a DTensor parameter's saved values are made (``DTensorParams.as_saved``), on both kinds of
torch the client meets: one whose DTensor is built from its spec (torch >= 2.4, FSDP2's way, which
leaves the local tensor where it is), and one whose constructor takes the mesh, placements and
global facts instead, where ``from_local`` builds it (torch 2.0 to 2.3: its ``__init__`` refuses the
spec, or the DTensor carries no spec at all). No daemon: the state dict tests of a whole run are in
test_partition.py."""

import torch

from fake_dtensor import FakeDTensor, Mesh, Shard
from muond import partition as part
from muond.dtensor_params import DTensorParams


class OlderDTensor(FakeDTensor):
    """A DTensor of torch before 2.4: its constructor takes (local, mesh, placements) and the
    global facts by keyword, so the spec-first construction raises TypeError, and ``from_local``
    (recorded here) is how one is made of a local tensor."""

    made_from_local = []

    def __init__(self, local, device_mesh, placements, *, shape, dtype, requires_grad, stride):
        spec = FakeDTensor.make(local, shape, device_mesh.size(), device_mesh.get_local_rank())._spec
        assert tuple(placements) == spec.placements and tuple(stride) == spec.tensor_meta.stride
        assert dtype == local.dtype
        super().__init__(local, spec, requires_grad=requires_grad)

    @classmethod
    def from_local(cls, local, device_mesh, placements, *, run_check, shape, stride):
        cls.made_from_local.append({"run_check": run_check, "shape": tuple(shape), "stride": tuple(stride)})
        return cls(local, device_mesh, placements, shape=shape, dtype=local.dtype, requires_grad=False,
                   stride=stride)


class WithoutSpec(OlderDTensor):
    """A DTensor whose spec is not there to read (``_spec`` None)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        spec = self._spec
        self.placements_kept, self.mesh_kept, self.meta_kept = spec.placements, spec.mesh, spec.tensor_meta
        self._spec = None

    placements = property(lambda self: self.placements_kept)
    device_mesh = property(lambda self: self.mesh_kept)
    shape = property(lambda self: self.meta_kept.shape)

    def stride(self):
        return self.meta_kept.stride


def _held(dtensor):
    """A DTensorParams holding ``dtensor`` (a parameter of global shape (5, 3), rank 1 of 2's
    rows) and the local tensor that holds it."""
    params = DTensorParams()
    group = params.localize({"params": [dtensor], "partition": part.rows([(5, 3)])})
    return params, group["params"][0]


def _older(kind):
    """Rank 1 of 2's DTensor of ``kind`` of a (5, 3) parameter: rows 3 and 4 of torch.chunk's cut."""
    local = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    return kind(local, Mesh(2, 1), (Shard(0),), shape=torch.Size((5, 3)), dtype=local.dtype, requires_grad=True,
                stride=(3, 1))


def test_a_dtensor_built_from_its_spec_keeps_the_saved_value_where_it_is():
    dtensor = FakeDTensor.of(torch.arange(15, dtype=torch.float32).reshape(5, 3), world=2, rank=1)
    params, held = _held(dtensor)
    value = torch.full((6,), 7.0)  # a master or slot of the part, flat
    saved = params.as_saved(held, value)
    assert type(saved) is FakeDTensor
    assert saved.shape == torch.Size((5, 3)) and saved.placements == (Shard(0),)
    assert saved.to_local().data_ptr() == value.data_ptr(), "the saved value was copied"
    assert not saved.requires_grad


def test_a_dtensor_whose_constructor_refuses_the_spec_is_made_by_from_local():
    for kind in (OlderDTensor, WithoutSpec):
        OlderDTensor.made_from_local.clear()
        params, held = _held(_older(kind))
        value = torch.full((6,), 3.0)
        saved = params.as_saved(held, value)
        assert isinstance(saved, OlderDTensor), kind.__name__
        assert OlderDTensor.made_from_local == [{"run_check": False, "shape": (5, 3), "stride": (3, 1)}], kind.__name__
        assert torch.equal(saved.to_local(), value.reshape(2, 3)), kind.__name__
        assert saved.shape == torch.Size((5, 3)) and saved.placements == (Shard(0),), kind.__name__


def test_a_parameter_that_is_not_a_dtensor_is_saved_as_it_is():
    params = DTensorParams()
    plain = torch.zeros(4, requires_grad=True)
    value = torch.ones(4)
    assert params.as_saved(plain, value) is value
