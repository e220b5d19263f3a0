"""``default_param_groups``: the usual Muon + AdamW split of a model's parameters.

Pure function over a module; it reads the model, never changes it.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, Optional, Set, Union

from torch import nn

# Final module names that mark an output head (Hugging Face, timm, nanoGPT, torchvision use these).
HEAD_NAMES = frozenset({"lm_head", "head", "output", "output_layer", "output_proj", "classifier",
                        "fc_out", "logits", "readout", "score"})
_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


def default_param_groups(model: nn.Module, *, muon: Optional[Mapping[str, Any]] = None,
                         adamw: Optional[Mapping[str, Any]] = None,
                         head: Optional[Iterable[Union[str, nn.Module]]] = None
                         ) -> List[Dict[str, Any]]:
    """Splits ``model``'s trainable parameters into a Muon group and an AdamW group.

    Rules, applied in order to every parameter with ``requires_grad``:

    1. Parameters of ``nn.Embedding``/``nn.EmbeddingBag`` modules, and any parameter that is the
       same tensor as one (tied input/output embeddings), go to **AdamW**.
    2. The output head goes to **AdamW**: the parameters of the modules named in ``head``
       (dotted names from ``named_modules()``, or the modules themselves); when ``head`` is None,
       those of modules whose last name component is one of ``HEAD_NAMES`` (``lm_head``,
       ``head``, ``output``, ``classifier``, ...) and of the last ``nn.Linear`` (in registration
       order) whose output width equals an embedding's vocabulary size (an untied LM head).
    3. Parameters with fewer than 2 dimensions (biases, norm gains, scalars) go to **AdamW**.
    4. Every other parameter (hidden matrices: linear, attention, convolution weights, and 3-D
       expert stacks) goes to **Muon**.

    Args:
        model: the module whose ``named_parameters()`` are split.
        muon: options of the Muon group, e.g. ``{"lr": 0.02, "weight_decay": 0.01}``.
        adamw: options of the AdamW group, e.g. ``{"lr": 3e-4, "betas": (0.9, 0.95)}``.
        head: the output head's modules or module names, to override the detection of rule 2.

    Returns:
        Up to two group dicts, Muon first, each with ``params`` (tensors), ``param_names`` and
        ``optimizer`` set; a group without parameters is left out. Feed them to
        ``muond.RemoteOptimizer`` (or ``muond.LocalOptimizer``).
    """
    modules = dict(model.named_modules())
    adam_ids: Set[int] = set()
    for module in modules.values():
        if isinstance(module, _EMBEDDINGS):
            adam_ids.update(id(p) for p in module.parameters(recurse=False))
    for module in _head_modules(modules, head):
        adam_ids.update(id(p) for p in module.parameters(recurse=False))

    muon_params, muon_names, adam_params, adam_names = [], [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if id(p) in adam_ids or p.dim() < 2:
            adam_params.append(p)
            adam_names.append(name)
        else:
            muon_params.append(p)
            muon_names.append(name)
    groups = []
    if muon_params:
        groups.append({"params": muon_params, "param_names": muon_names, "optimizer": "muon",
                       **dict(muon or {})})
    if adam_params:
        groups.append({"params": adam_params, "param_names": adam_names, "optimizer": "adamw",
                       **dict(adamw or {})})
    return groups


def _head_modules(modules: Dict[str, nn.Module],
                  head: Optional[Iterable[Union[str, nn.Module]]]) -> List[nn.Module]:
    if head is not None:
        found = []
        for item in head:
            if isinstance(item, nn.Module):
                found.append(item)
            elif item in modules:
                found.append(modules[item])
            else:
                raise ValueError(f"head: the model has no module named {item!r}")
        return found
    found = [m for name, m in modules.items() if name and name.rsplit(".", 1)[-1] in HEAD_NAMES]
    vocab_sizes = {m.num_embeddings for m in modules.values() if isinstance(m, _EMBEDDINGS)}
    vocab_linears = [m for m in modules.values()
                     if isinstance(m, nn.Linear) and m.out_features in vocab_sizes]
    if vocab_linears:
        found.append(vocab_linears[-1])
    return found
