"""What torch.distributed.checkpoint's optimizer state-dict helpers (torch >= 2.2, in
torch/distributed/checkpoint/state_dict.py; the suite's torch 1.13 lacks them) make of an
optimizer's ``state_dict()`` and hand back to its ``load_state_dict``, re-enacted on plain dicts:
``get_optimizer_state_dict`` first steps an optimizer whose ``state`` is empty, or lacks one of its
parameters, once with zero gradients (here asserted not to be needed), then keys the state and the
groups' "params" by the model's names of the groups' parameters (matched by identity) and keeps
only "state" and "param_groups"; ``set_optimizer_state_dict`` checks the state again, then gives
the optimizer its groups in its own order, each parameter's state (of those that require grad)
and its saved group's entries. With ``flatten_optimizer_state_dict=True`` the get makes one key per
state value ("state.<name>.<key>") and per parameter's group entry ("param_groups.<name>.<key>"),
and the set asks the checkpoint for the keys ``opt.state[p]`` and the optimizer's own groups have.
``names_by_id``: ``id(parameter) → name`` of the model's parameters.
"""


def keep_as_get_optimizer_state_dict(opt, names_by_id, flatten=False):
    assert opt.state and all(p in opt.state for g in opt.param_groups for p in g["params"]), \
        "the helpers would step the optimizer with zero gradients to fill its state"
    order = [names_by_id[id(p)] for g in opt.param_groups for p in g["params"]]
    saved = opt.state_dict()
    kept = {"state": {order[i]: dict(entry) for i, entry in saved["state"].items()},
            "param_groups": [dict(g, params=[order[i] for i in g["params"]]) for g in saved["param_groups"]]}
    if not flatten:
        return kept
    flat = {f"state.{name}.{key}": value for name, entry in kept["state"].items() for key, value in entry.items()}
    for group in kept["param_groups"]:
        for name in group["params"]:
            flat.update({f"param_groups.{name}.{k}": v for k, v in group.items() if k != "params"})
    return flat


def hand_back_as_set_optimizer_state_dict(opt, names_by_id, kept, flatten=False):
    assert opt.state and all(p in opt.state for g in opt.param_groups for p in g["params"]), \
        "the helpers would step the optimizer with zero gradients to fill its state"
    state, groups = {}, []
    for group in opt.param_groups:
        out = {"params": []}
        for p in group["params"]:
            name = names_by_id[id(p)]
            out["params"].append(name)
            if flatten:
                state[name] = {key: kept[f"state.{name}.{key}"] for key in opt.state[p]}
                out.update({k: kept[f"param_groups.{name}.{k}"] for k in group if k != "params"})
                continue
            if p.requires_grad:
                state[name] = kept["state"][name]
            for saved in kept["param_groups"]:
                if name in saved["params"]:
                    out.update({k: v for k, v in saved.items() if k != "params"})
        groups.append(out)
    return {"state": state, "param_groups": groups}
