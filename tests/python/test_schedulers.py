"""torch.optim's contract for ``param_groups`` and ``defaults``, which torch's schedulers rely on,
against the real daemon and torch's own optimizers: OneCycleLR at its defaults cycles AdamW's
betas[0] (sent with each step), CyclicLR cycles SGD's momentum, LambdaLR scales lr, all tracking
torch's AdamW and SGD; a group option changed by hand that no step may change raises at the next
step, naming it, with nothing sent; and a model of Muon and AdamW groups lists in ``defaults`` only
what every group has."""

import copy

import pytest
import torch

import muond

STEPS = 30


def model_pair(seed=11):
    torch.manual_seed(seed)
    a = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    b = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    b.load_state_dict(a.state_dict())
    return a, b


def loss_of(model, step):
    gen = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
    return torch.nn.functional.mse_loss(model(x), y)


def train_side_by_side(ours, theirs, a, b, scheduler_of):
    """Steps both optimizers STEPS times under the same scheduler; the largest parameter difference
    and the last step's (lr, betas or momentum) of group 0 of each."""
    s_ours, s_theirs = scheduler_of(ours), scheduler_of(theirs)
    for step in range(1, STEPS + 1):
        for model, opt in ((a, ours), (b, theirs)):
            opt.zero_grad()
            loss_of(model, step).backward()
            opt.step()
        s_ours.step()
        s_theirs.step()
    worst = max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters()))
    keys = ("lr", "betas", "momentum")
    return worst, ({k: ours.param_groups[0].get(k) for k in keys}, {k: theirs.param_groups[0].get(k) for k in keys})


def test_one_cycle_at_its_defaults_cycles_adamws_betas(endpoint):
    a, b = model_pair()
    # The group carries its own options, as muond.default_param_groups builds them.
    ours = muond.RemoteOptimizer([{"params": list(a.parameters()), "optimizer": "adamw", "lr": 1e-3,
                                   "betas": (0.9, 0.999), "weight_decay": 0.01}], endpoint=endpoint)
    theirs = torch.optim.AdamW(b.parameters(), lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01)
    assert "betas" in ours.defaults and "momentum" not in ours.defaults
    with ours:
        worst, (mine, torchs) = train_side_by_side(
            ours, theirs, a, b, lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=STEPS))
    print(f"OneCycleLR, AdamW: largest parameter difference {worst:.2e}; betas {mine['betas']} / {torchs['betas']}")
    assert mine["betas"] == torchs["betas"] and mine["betas"][0] != 0.9, "betas[0] was cycled"
    # The daemon's fp32 AdamW against torch's: ≲ 1e-6 relative a step, on parameters of ~0.5.
    assert worst < 1e-5


def test_cyclic_lr_cycles_sgds_momentum(endpoint):
    a, b = model_pair(12)
    ours = muond.RemoteOptimizer([{"params": list(a.parameters()), "optimizer": "sgd", "lr": 0.01,
                                   "momentum": 0.9}], endpoint=endpoint)
    theirs = torch.optim.SGD(b.parameters(), lr=0.01, momentum=0.9)
    with ours:
        worst, (mine, torchs) = train_side_by_side(
            ours, theirs, a, b,
            lambda o: torch.optim.lr_scheduler.CyclicLR(o, base_lr=0.001, max_lr=0.05, step_size_up=7))
    print(f"CyclicLR, SGD: largest parameter difference {worst:.2e}; momentum {mine['momentum']}")
    assert mine["momentum"] == torchs["momentum"] and mine["momentum"] != 0.9
    assert worst < 1e-5


def test_lambda_lr_scales_the_learning_rate(endpoint):
    a, b = model_pair(13)
    ours = muond.RemoteOptimizer(a.parameters(), endpoint=endpoint, optimizer="adamw", lr=3e-3)
    theirs = torch.optim.AdamW(b.parameters(), lr=3e-3)
    with ours:
        worst, (mine, torchs) = train_side_by_side(
            ours, theirs, a, b, lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.9 ** s))
    assert mine["lr"] == torchs["lr"] and worst < 1e-5


def test_a_fixed_option_changed_by_hand_raises_naming_it(endpoint):
    a, _ = model_pair(14)
    with muond.RemoteOptimizer(a.parameters(), endpoint=endpoint, optimizer="adamw") as opt:
        loss_of(a, 1).backward()
        opt.step()
        opt.param_groups[0]["eps"] = 1e-6  # torch's AdamW would use it; muond's session fixed it
        loss_of(a, 2).backward()
        with pytest.raises(ValueError, match=r"param_groups\[0\]\['eps'\] changed from 1e-08 to 1e-06"):
            opt.step()
        assert opt.last_step == 1, "nothing was sent"
        opt.param_groups[0]["eps"] = 1e-8
        opt.param_groups[0]["betas"] = (0.85, 0.99)  # betas may change: sent with the step
        opt.step()
        assert opt.last_step == 2 and opt.last_info.applied


def test_mixed_groups_list_only_what_every_group_has(endpoint):
    torch.manual_seed(15)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    with muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint) as opt:
        assert "lr" in opt.defaults and "weight_decay" in opt.defaults
        assert "momentum" not in opt.defaults and "betas" not in opt.defaults
        # torch's own refusal, naming the way out, instead of a silent half-cycled momentum.
        with pytest.raises(ValueError, match="cycle_momentum"):
            torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=10)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=10, cycle_momentum=False)
        loss_of(model, 1).backward()
        opt.step()
        scheduler.step()
        assert opt.last_info.applied
        # A key of another optimizer set on a group raises, naming it.
        opt.param_groups[1]["momentum"] = 0.9
        with pytest.raises(ValueError, match=r"'momentum' is not an option of adamw"):
            opt.step()


RESUMED_SCHEDULES = {
    # Chainable: each lr is computed from the group's lr before it.
    "step_lr": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    # Sets lr and betas[0] itself when made (its first step's), then computes them from its count.
    "one_cycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=8),
}


def adamw_on(model, endpoint, session=None):
    return muond.RemoteOptimizer([{"params": list(model.parameters()), "optimizer": "adamw", "lr": 0.02,
                                   "betas": (0.9, 0.999), "weight_decay": 0.01}],
                                 endpoint=endpoint, session=session)


def run_schedule(model, opt, scheduler, steps):
    """Trains ``steps`` under ``scheduler``; the (lr, betas) of group 0 each step ran with."""
    used = []
    for step in steps:
        opt.zero_grad()
        loss_of(model, step).backward()
        used.append((opt.param_groups[0]["lr"], tuple(opt.param_groups[0]["betas"])))
        opt.step()
        scheduler.step()
    return used


@pytest.mark.parametrize("restart", ["attach", "daemon_restarted"])
@pytest.mark.parametrize("schedule", sorted(RESUMED_SCHEDULES))
def test_a_trainer_that_attaches_to_resume_goes_on_with_its_schedule(start_daemon, tmp_path, schedule, restart):
    # The resume of python/README.md (Checkpoints and restarts): a new trainer attaches to the
    # session, makes its scheduler, loads the scheduler's state dict saved with the checkpoint
    # (step 3), calls resume_param_groups(scheduler) and steps the scheduler over the step the
    # daemon took after it (4); its steps run with the values of an uninterrupted run. After a
    # daemon restart the record of the last step's values comes from the checkpoint and the
    # journal's replay.
    flags = ("--state-dir", tmp_path / "state", "--durability", "journal")
    daemon = start_daemon(*flags)
    make = RESUMED_SCHEDULES[schedule]
    straight, model = model_pair(16)
    with adamw_on(straight, daemon.endpoint) as opt:
        expected = run_schedule(straight, opt, make(opt), range(1, 9))

    session = f"resume-{schedule}-{restart}"
    opt = adamw_on(model, daemon.endpoint, session)
    scheduler = make(opt)
    used = run_schedule(model, opt, scheduler, range(1, 4))
    assert opt.checkpoint() == 3
    saved = {"step": 3, "state": scheduler.state_dict()}  # saved with the checkpoint
    used += run_schedule(model, opt, scheduler, range(4, 5))  # journaled: the daemon keeps step 4
    opt.close(keep_session=True)
    if restart == "daemon_restarted":
        daemon.kill()
        daemon = start_daemon(*flags, workdir=daemon.workdir)

    restarted, _ = model_pair(17)  # other weights: the session's come back
    opt = adamw_on(restarted, daemon.endpoint, session)
    assert opt.attached and opt.last_step == 4
    assert (opt.param_groups[0]["lr"], opt.param_groups[0]["betas"]) == used[-1], "the last step's values"
    scheduler = make(opt)
    scheduler.load_state_dict(saved["state"])
    opt.resume_param_groups(scheduler)
    for _ in range(opt.last_step - saved["step"]):
        scheduler.step()  # the step the daemon took after the save
    used += run_schedule(restarted, opt, scheduler, range(5, 9))
    with pytest.raises(RuntimeError, match=r"attached at \(4\); the session is at step 8"):
        opt.resume_param_groups()  # the record is of step 4, param_groups have moved on
    opt.close()
    assert used == expected
    assert len(set(used)) > 2, "the schedule moved the values"
    for p, q in zip(restarted.parameters(), straight.parameters()):
        assert torch.equal(p.detach(), q.detach())


def test_param_groups_edits_no_step_can_carry_raise_before_anything_is_sent(endpoint):
    a, _ = model_pair(18)
    with muond.RemoteOptimizer(a.parameters(), endpoint=endpoint, optimizer="sgd", lr=0.1, momentum=0.9) as opt:
        loss_of(a, 1).backward()
        # A value of the wrong type, named with its group (torch's optimizers refuse strings too).
        for key, bad, error in (("lr", "0.01", TypeError), ("weight_decay", "x", TypeError),
                                ("momentum", None, ValueError)):
            saved = opt.param_groups[0][key]
            opt.param_groups[0][key] = bad
            with pytest.raises(error, match=rf"param_groups\[0\]: .*{key}"):
                opt.step()
            opt.param_groups[0][key] = saved
        # A tensor added to (or taken from) a group's params: the session's parameters are fixed.
        extra = torch.nn.Parameter(torch.zeros(3))
        opt.param_groups[0]["params"].append(extra)
        with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\] changed .*4 tensors then, 5 now"):
            opt.step()
        opt.param_groups[0]["params"].pop()
        assert opt.last_step == 0, "nothing was sent"
        opt.step()
        assert opt.last_step == 1 and opt.last_info.applied



RESUMABLE = {
    "reduce_on_plateau": (lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=0), True),
    "sequential_one_cycle": (lambda o: torch.optim.lr_scheduler.SequentialLR(
        o, [torch.optim.lr_scheduler.ConstantLR(o, factor=0.5, total_iters=3),
            torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=20)], milestones=[3]), False),
    "chained": (lambda o: torch.optim.lr_scheduler.ChainedScheduler(
        [torch.optim.lr_scheduler.ConstantLR(o, factor=0.5, total_iters=3),
         torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9)]), False),
}  # (CyclicLR's state dict holds a WeakMethod, which torch 1.13's can neither copy nor pickle.)


@pytest.mark.parametrize("kind", sorted(RESUMABLE))
def test_resume_takes_each_schedulers_values_for_its_count(kind):
    """resume.apply_scheduler, the scheduler half of resume_param_groups, against torch's own SGD
    (no daemon): a run resumed from the scheduler's state at step 5 of 8, with the groups holding
    what step 8 ran with (an attach's record), stepped over steps 6 to 8, runs step 9 with the
    values of the uninterrupted run — lr from the scheduler's record (ReduceLROnPlateau's too, whose
    reduction after the last step no optimizer step has seen), momentum recomputed where a
    OneCycleLR or CyclicLR inside it cycles it."""
    from muond import resume  # noqa: PLC0415 - the module under test, beside the daemon's tests

    make, metric = RESUMABLE[kind]
    losses = [1.0, 1.0, 0.9, 0.9, 0.9, 0.9, 0.8, 0.8, 0.8]  # a plateau: ReduceLROnPlateau reduces

    def run(opt, scheduler, steps):
        used = []
        for step in steps:
            used.append((opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"]))
            opt.step()
            scheduler.step(losses[step - 1]) if metric else scheduler.step()
        return used

    w = torch.nn.Parameter(torch.ones(3))
    straight = torch.optim.SGD([w], lr=0.02, momentum=0.9)
    s_straight = make(straight)
    expected = run(straight, s_straight, range(1, 10))

    first = torch.optim.SGD([w], lr=0.02, momentum=0.9)
    s_first = make(first)
    run(first, s_first, range(1, 6))
    saved = copy.deepcopy(s_first.state_dict())
    last = run(first, s_first, range(6, 9))[-1]  # step 8's values: what the daemon's record says

    resumed = torch.optim.SGD([w], lr=0.02, momentum=0.9)
    scheduler = make(resumed)
    resumed.param_groups[0]["lr"], resumed.param_groups[0]["momentum"] = last
    scheduler.load_state_dict(saved)
    resume.apply_scheduler(resumed, scheduler)
    for step in range(6, 9):
        scheduler.step(losses[step - 1]) if metric else scheduler.step()
    assert (resumed.param_groups[0]["lr"], resumed.param_groups[0]["momentum"]) == pytest.approx(expected[8])
    assert len(set(expected)) > 2, "the schedule moved the values"
