"""Parameters the trainer changes in place (python/README.md, Parameters changed by the trainer): the
daemon holds the masters, so a step after such a change is refused before anything is sent, naming
the parameters, and upload_parameters() makes the model's values the masters while keeping the
optimizer state."""

import pytest
import torch

import muond


def sgd_pair(lr=0.1, momentum=0.9):
    """Two equal 2-parameter models: one behind a RemoteOptimizer-to-be, one for torch's SGD."""
    torch.manual_seed(3)
    ours = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    options = {"optimizer": "sgd", "lr": lr, "momentum": momentum}
    return ours, theirs, options


def gradients(step):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(4, 3, generator=gen), torch.randn(3, generator=gen)]


def test_weights_loaded_after_construction_are_refused_then_uploaded(endpoint):
    ours, theirs, options = sgd_pair()
    opt = muond.RemoteOptimizer([{"params": [("w", ours[0]), ("b", ours[1])], **options}],
                                endpoint=endpoint)
    with torch.no_grad():  # model.load_state_dict(pretrained) after the optimizer was made
        ours[0].fill_(7.0)
        theirs[0].fill_(7.0)
    for p, g in zip(ours, gradients(1)):
        p.grad = g.clone()
    with pytest.raises(ValueError, match=r"changed in place .*'w' \(1 of 2\).*upload_parameters"):
        opt.step()
    assert opt.last_step == 0 and opt.last_info is None, "nothing was sent"
    assert torch.all(ours[0] == 7.0), "the model keeps the loaded values"

    opt.upload_parameters()
    reference = torch.optim.SGD(theirs, lr=options["lr"], momentum=options["momentum"])
    for step in range(1, 4):
        for p, q, g in zip(ours, theirs, gradients(step)):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        reference.step()
    opt.close()
    for p, q in zip(ours, theirs):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-6), (p, q)


def test_a_clamp_after_a_step_is_uploaded_with_the_momentum_kept(endpoint):
    # WGAN's weight clipping: step, then clamp in place. The upload keeps the momentum, as torch's
    # SGD does when its parameters are clamped between steps.
    ours, theirs, options = sgd_pair()
    opt = muond.RemoteOptimizer([{"params": [("w", ours[0]), ("b", ours[1])], **options}],
                                endpoint=endpoint)
    reference = torch.optim.SGD(theirs, lr=options["lr"], momentum=options["momentum"])
    for step in range(1, 5):
        for p, q, g in zip(ours, theirs, gradients(step)):
            p.grad, q.grad = g.clone(), g.clone()
        if step > 1:
            with pytest.raises(ValueError, match=r"'w', 'b' \(2 of 2\)"):
                opt.step()
            assert opt.last_step == step - 1
            opt.upload_parameters()
        opt.step()
        reference.step()
        with torch.no_grad():
            for p, q in zip(ours, theirs):
                p.clamp_(-0.5, 0.5)
                q.clamp_(-0.5, 0.5)
    opt.close()
    for p, q in zip(ours, theirs):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-6), (p, q)


def test_reading_parameters_and_stepping_changes_nothing_to_refuse(endpoint):
    ours, _, options = sgd_pair()
    opt = muond.RemoteOptimizer([{"params": [("w", ours[0]), ("b", ours[1])], **options}],
                                endpoint=endpoint)
    for step in range(1, 4):
        for p, g in zip(ours, gradients(step)):
            p.grad = g.clone()
        _ = sum(float(p.sum()) for p in ours)  # reads only
        opt.step()
        opt.zero_grad(set_to_none=False)  # changes the gradients in place, not the parameters
    state = opt.state_dict()
    opt.load_state_dict(state)  # writes the parameters itself
    for p, g in zip(ours, gradients(4)):
        p.grad = g.clone()
    opt.step()
    assert opt.last_step == 4
    opt.close()


def test_an_upload_changes_only_the_changed_elements_of_a_bf16_model(endpoint):
    # The daemon keeps fp32 masters of a bf16 model: an upload after one element was changed
    # replaces that element's master and keeps every other master's fp32 bits.
    torch.manual_seed(9)
    w = torch.nn.Parameter(torch.randn(8, 8).to(torch.bfloat16))
    opt = muond.RemoteOptimizer([{"params": [("w", w)], "optimizer": "adamw", "lr": 1e-2}],
                                endpoint=endpoint)
    w.grad = torch.randn(8, 8).to(torch.bfloat16)
    opt.step()
    before = opt.state_dict()["state"][0]["master"].clone()
    with torch.no_grad():
        w[0, 0] = 3.0
    opt.upload_parameters()
    after = opt.state_dict()["state"][0]["master"]
    opt.close()
    assert after[0, 0] == 3.0
    changed = (after != before).nonzero().tolist()
    assert changed == [[0, 0]], changed
    assert not torch.equal(before.to(torch.bfloat16).float(), before), "the masters hold more than bf16"


def test_warn_and_ignore_let_the_step_go_on(endpoint, caplog):
    for mode in ("warn", "ignore"):
        ours, _, options = sgd_pair()
        opt = muond.RemoteOptimizer([{"params": [("w", ours[0]), ("b", ours[1])], **options}],
                                    endpoint=endpoint, parameters_changed=mode)
        caplog.clear()
        for step in range(1, 4):
            with torch.no_grad():
                ours[1].clamp_(-0.1, 0.1)  # overwritten by each answer, as asked
            for p, g in zip(ours, gradients(step)):
                p.grad = g.clone()
            opt.step()
        said = [r for r in caplog.records if "changed in place" in r.getMessage()]
        assert len(said) == (1 if mode == "warn" else 0), (mode, said)
        assert opt.last_step == 3
        opt.close()
    with pytest.raises(ValueError, match="parameters_changed: 'raise', 'warn' or 'ignore'"):
        muond.RemoteOptimizer([{"params": [("w", ours[0])], **options}], endpoint=endpoint,
                              parameters_changed="sometimes")


def test_upload_parameters_is_lock_step_only(endpoint):
    ours, _, options = sgd_pair()
    opt = muond.RemoteOptimizer([{"params": [("w", ours[0]), ("b", ours[1])], **options}],
                                endpoint=endpoint, session="upload-quorum", world_size=2, rank=0,
                                sync_mode="quorum",
                                min_ranks=1)
    with pytest.raises(ValueError, match="upload_parameters: not in a quorum session"):
        opt.upload_parameters()
    opt.close()
