#!/usr/bin/env python3
"""Trains a small character-level GPT on CPU with its optimizer step running on a muond daemon.

The model's forward and backward stay here; `muond.RemoteOptimizer` sends the gradients to the
daemon, which runs Muon on the hidden matrices and AdamW on embeddings, head and gains, and sends
the updated weights back. The training loop is the ordinary torch one.

    muond --listen 127.0.0.1:50051 --backend cpu &
    python3 examples/train_gpt.py --endpoint 127.0.0.1:50051 --steps 300

    # or let the script start (and stop) the daemon itself:
    python3 examples/train_gpt.py --spawn-daemon build/muond

    # the same model, seed and batches trained with an in-process torch Muon+AdamW as well:
    python3 examples/train_gpt.py --endpoint 127.0.0.1:50051 --compare-local

The default corpus comes from a small probabilistic grammar of English-like sentences (agreement,
relative clauses, questions), generated deterministically from --seed; --data FILE trains on any
text file instead.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn



def _import_muond():
    """The installed muond package, else the one of this source checkout: python/ beside
    examples/, with the gRPC stubs of a CMake build (build/python), or generated on the spot."""
    try:
        import muond
        return muond
    except ImportError:
        pass
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "python"))
    sys.path.extend(str(p) for p in [root / "build" / "python", *sorted(root.glob("build*/python"))]
                    if (p / "muond" / "_proto").is_dir())
    for name in [n for n in sys.modules if n == "muond" or n.startswith("muond.")]:
        del sys.modules[name]  # a half-imported package from the first attempt
    if not any((Path(p) / "muond" / "_proto").is_dir() for p in sys.path[1:]):
        import atexit
        import importlib.util
        import shutil
        spec = importlib.util.spec_from_file_location("muond_codegen",
                                                      root / "python" / "muond" / "_codegen.py")
        codegen = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(codegen)
        out = tempfile.mkdtemp(prefix="muond-stubs-")
        atexit.register(shutil.rmtree, out, ignore_errors=True)
        codegen.generate(root / "proto", out)
        sys.path.append(out)
    import muond
    return muond


muond = _import_muond()

try:
    from tqdm import tqdm
except ImportError:  # plain prints instead of a progress bar
    tqdm = None


# ---------------------------------------------------------------------------------------------
# Corpus: a probabilistic grammar of English-like sentences.

NOUNS = [("dog", "dogs"), ("cat", "cats"), ("child", "children"), ("teacher", "teachers"),
         ("farmer", "farmers"), ("bird", "birds"), ("king", "kings"), ("doctor", "doctors"),
         ("fox", "foxes"), ("sailor", "sailors"), ("girl", "girls"), ("wolf", "wolves")]
THINGS = ["the river", "the old bridge", "a red ball", "the garden", "the letter", "a small boat",
          "the bread", "the window", "a long song", "the map", "the hill", "the lamp"]
TRANSITIVE = [("sees", "see"), ("likes", "like"), ("follows", "follow"), ("finds", "find"),
              ("watches", "watch"), ("helps", "help"), ("remembers", "remember"),
              ("carries", "carry")]
INTRANSITIVE = [("sleeps", "sleep"), ("runs", "run"), ("waits", "wait"), ("sings", "sing"),
                ("laughs", "laugh"), ("works", "work")]
ADJECTIVES = ["small", "old", "quiet", "happy", "tired", "clever", "young", "brave", "hungry"]
ADVERBS = ["quickly", "slowly", "often", "never", "always", "again", "today"]
PLACES = ["near the river", "in the garden", "under the bridge", "behind the house",
          "at the market", "on the hill", "by the sea"]
NAMES = ["Alice", "Bob", "Mara", "Tom", "Ines", "Karl"]
LINKS = ["because", "when", "while", "although", "after"]


class Grammar:
    """Sentences with subject-verb agreement, adjectives, relative clauses, prepositional
    phrases, subordinate clauses and yes/no questions; deterministic for a given seed."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def _pick(self, items):
        return items[self.rng.randrange(len(items))]

    def noun_phrase(self, depth: int):
        """(text, plural) of a subject or object."""
        r = self.rng.random()
        if r < 0.15:
            return self._pick(NAMES), False
        plural = self.rng.random() < 0.4
        noun = self._pick(NOUNS)[1 if plural else 0]
        det = self._pick(["the", "some", "many", "these"] if plural else
                         ["the", "a", "every", "this"])
        words = [det]
        if self.rng.random() < 0.4:
            words.append(self._pick(ADJECTIVES))
        words.append(noun)
        if depth < 2 and self.rng.random() < 0.2:
            words += ["that", self.verb_phrase(plural, depth + 1)]
        return " ".join(words), plural

    def verb_phrase(self, plural: bool, depth: int) -> str:
        if self.rng.random() < 0.6:
            verb = self._pick(TRANSITIVE)[1 if plural else 0]
            obj = (self._pick(THINGS) if self.rng.random() < 0.5
                   else self.noun_phrase(depth + 1)[0])
            words = [verb, obj]
        else:
            words = [self._pick(INTRANSITIVE)[1 if plural else 0]]
        if self.rng.random() < 0.3:
            words.append(self._pick(ADVERBS))
        if self.rng.random() < 0.3:
            words.append(self._pick(PLACES))
        return " ".join(words)

    def clause(self, depth: int = 0) -> str:
        subject, plural = self.noun_phrase(depth)
        text = f"{subject} {self.verb_phrase(plural, depth)}"
        if depth == 0 and self.rng.random() < 0.25:
            text += f" {self._pick(LINKS)} {self.clause(depth + 1)}"
        return text

    def question(self) -> str:
        subject, plural = self.noun_phrase(1)
        verb = self._pick(TRANSITIVE)[1]  # base form after do/does
        return f"{'do' if plural else 'does'} {subject} {verb} {self._pick(THINGS)}?"

    def sentence(self) -> str:
        text = self.question() if self.rng.random() < 0.15 else self.clause() + "."
        return text[0].upper() + text[1:]

    def text(self, num_chars: int) -> str:
        lines, size = [], 0
        while size < num_chars:
            paragraph = " ".join(self.sentence() for _ in range(self.rng.randint(2, 5)))
            lines.append(paragraph)
            size += len(paragraph) + 1
        return "\n".join(lines)


class CharData:
    """A text as character ids, split 90/10, and seeded batch sampling."""

    def __init__(self, text: str, seed: int, context: int):
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        cut = int(0.9 * len(ids))
        self.train, self.val = ids[:cut], ids[cut:]
        self.context = context
        self.seed = seed
        if len(self.val) <= context + 1:
            raise SystemExit(f"the text is too short for a context of {context} characters")

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def batches(self, batch_size: int, split: str = "train", seed_offset: int = 0):
        data = self.train if split == "train" else self.val
        gen = torch.Generator().manual_seed(self.seed + seed_offset)
        while True:
            starts = torch.randint(len(data) - self.context - 1, (batch_size,), generator=gen)
            x = torch.stack([data[s:s + self.context] for s in starts.tolist()])
            y = torch.stack([data[s + 1:s + 1 + self.context] for s in starts.tolist()])
            yield x, y

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)


# ---------------------------------------------------------------------------------------------
# Model: a pre-norm GPT with separate q, k, v projections (each its own Muon matrix).

class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d_model)
        self.q = nn.Linear(d_model, d_model, bias=False)
        self.k = nn.Linear(d_model, d_model, bias=False)
        self.v = nn.Linear(d_model, d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model, bias=False)
        self.fc_proj = nn.Linear(4 * d_model, d_model, bias=False)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.n_head
        q, k, v = (m(x).view(b, t, h, d // h).transpose(1, 2) for m in (self.q, self.k, self.v))
        if hasattr(F, "scaled_dot_product_attention"):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # torch 1.x
            att = (q @ k.transpose(-2, -1)) / math.sqrt(d // h)
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            y = att.masked_fill(mask, float("-inf")).softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, context: int, d_model: int, n_layer: int, n_head: int):
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)
        nn.init.zeros_(self.lm_head.weight)

    def forward(self, idx: torch.Tensor, targets=None):
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    @torch.no_grad()
    def sample(self, prompt: torch.Tensor, length: int, temperature: float, seed: int):
        gen = torch.Generator().manual_seed(seed)
        idx = prompt.clone()
        for _ in range(length):
            logits = self(idx[:, -self.context:])[:, -1] / temperature
            nxt = torch.multinomial(logits.softmax(-1), 1, generator=gen)
            idx = torch.cat([idx, nxt], dim=1)
        return idx[0].tolist()


# ---------------------------------------------------------------------------------------------
# Training.

def muon_option(text: str):
    """KEY=VALUE of --muon-option: the value as a Python literal (4, 0.5, True), else the string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def param_groups(model: nn.Module, args):
    muon = {"lr": args.muon_lr, "momentum": 0.95, "weight_decay": args.weight_decay}
    muon.update(dict(args.muon_option))
    if muon.get("optimizer") == "dion2":
        del muon["momentum"]  # Dion2's momentum sums the gradients (docs/algorithms.md, Dion2)
    return muond.default_param_groups(
        model, muon=muon,
        adamw={"lr": args.adamw_lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0})


def lr_factor(step: int, total: int, warmup: int) -> float:
    """Linear warmup, then linear decay to 10% (LambdaLR multiplier for `step` = 0, 1, ...)."""
    if step < warmup:
        return (step + 1) / warmup
    return max(0.1, 1.0 - 0.9 * (step - warmup) / max(1, total - warmup))


@torch.no_grad()
def evaluate(model: GPT, data: CharData, args) -> float:
    model.eval()
    batches = data.batches(args.batch_size, "val", seed_offset=1)
    loss = sum(model(*next(batches)).item() for _ in range(args.eval_batches)) / args.eval_batches
    model.train()
    return loss


def train(name: str, data: CharData, args, make_optimizer):
    """Trains a fresh model (seeded) with the optimizer from `make_optimizer(groups)`; returns the
    model and a dict of per-step losses and times."""
    torch.manual_seed(args.seed)
    model = GPT(data.vocab_size, args.context, args.d_model, args.n_layer, args.n_head)
    optimizer = make_optimizer(param_groups(model, args))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, args.steps, args.warmup))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[{name}] {n_params / 1e6:.2f}M parameters, {args.steps} steps of "
          f"{args.batch_size}x{args.context} characters")
    losses, times, daemon = [], [], []
    batches = data.batches(args.batch_size)
    progress = tqdm(range(1, args.steps + 1), desc=name, unit="step", dynamic_ncols=True,
                    file=sys.stdout, mininterval=0.1 if sys.stdout.isatty() else 2.0
                    ) if tqdm and not args.no_progress else None
    try:
        for step in progress or range(1, args.steps + 1):
            started = time.perf_counter()
            x, y = next(batches)
            loss = model(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            times.append(time.perf_counter() - started)
            losses.append(loss.item())
            info = getattr(optimizer, "last_info", None)
            if info is not None:
                daemon.append(info.compute_seconds)
            line = f"loss {losses[-1]:.4f}  {1000 * times[-1]:.0f} ms/step"
            if progress is not None:
                progress.set_postfix_str(line)
            elif step == 1 or step % args.print_every == 0 or step == args.steps:
                print(f"[{name}] step {step:4d}/{args.steps}  {line}", flush=True)
            if args.eval_every and step % args.eval_every == 0 and step != args.steps:
                message = f"[{name}] step {step}: val loss {evaluate(model, data, args):.4f}"
                (progress.write if progress is not None else print)(message)
    finally:
        if progress is not None:
            progress.close()
        if hasattr(optimizer, "close"):
            optimizer.close()
    val = evaluate(model, data, args)
    steady = times[1:] or times
    summary = {"losses": losses, "step_seconds": times, "daemon_seconds": daemon, "val_loss": val,
               "mean_step_seconds": sum(steady) / len(steady)}
    window = min(10, len(losses))
    print(f"[{name}] loss {losses[0]:.4f} -> {sum(losses[-window:]) / window:.4f} "
          f"(mean of the last {window}), val {val:.4f}, "
          f"{1000 * summary['mean_step_seconds']:.0f} ms/step"
          + (f" (optimizer on the daemon {1000 * sum(daemon) / len(daemon):.1f} ms/step)"
             if daemon else ""))
    return model, summary


def print_side_by_side(remote: dict, local: dict, every: int) -> None:
    print("\n step   muond loss   local loss   difference")
    n = min(len(remote["losses"]), len(local["losses"]))
    for i in range(n):
        step = i + 1
        if step == 1 or step % every == 0 or step == n:
            a, b = remote["losses"][i], local["losses"][i]
            print(f"{step:5d}   {a:10.4f}   {b:10.4f}   {a - b:+10.2e}")
    print(f"  val   {remote['val_loss']:10.4f}   {local['val_loss']:10.4f}   "
          f"{remote['val_loss'] - local['val_loss']:+10.2e}")
    print(f" time   {1000 * remote['mean_step_seconds']:7.0f} ms   "
          f"{1000 * local['mean_step_seconds']:7.0f} ms   per step\n")


class SpawnedDaemon:
    """Runs the muond binary on a free loopback port until stopped."""

    def __init__(self, binary: str, backend: str):
        self.dir = tempfile.TemporaryDirectory(prefix="muond-example-")
        port_file = Path(self.dir.name) / "port"
        self.proc = subprocess.Popen([binary, "--listen", "127.0.0.1:0", "--port-file",
                                      str(port_file), "--backend", backend, "--log-level", "warn"])
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None:
                raise SystemExit(f"{binary} exited with status {self.proc.returncode}")
            if time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"{binary} did not report its port within 30 s")
            time.sleep(0.05)
        self.endpoint = f"127.0.0.1:{port_file.read_text().strip()}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.dir.cleanup()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--endpoint", default=os.environ.get("MUOND_ENDPOINT", "127.0.0.1:50051"),
                   help="the muond daemon's host:port")
    p.add_argument("--spawn-daemon", metavar="PATH",
                   help="start this muond binary on a free port and use it (ignores --endpoint)")
    p.add_argument("--daemon-backend", default="cpu", help="--backend of a spawned daemon")
    p.add_argument("--session", help="session id (default: a fresh one); an existing session "
                                     "with the same spec is attached to and resumed")
    p.add_argument("--wire-dtype", default="fp32", choices=["bf16", "fp32"],
                   help="dtype of the gradients on the wire")
    p.add_argument("--data", metavar="FILE", help="train on this text file instead of the "
                                                  "generated corpus")
    p.add_argument("--corpus-chars", type=int, default=400_000,
                   help="size of the generated corpus")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layer", type=int, default=3)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--muon-lr", type=float, default=0.02)
    p.add_argument("--adamw-lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.0, help="Muon groups' weight decay")
    p.add_argument("--muon-option", type=muon_option, action="append", default=[], metavar="KEY=VALUE",
                   help="another Muon group option, e.g. momentum_normalization=row, num_heads=4 or "
                        "optimizer=dion2 (repeatable)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--eval-every", type=int, default=100, help="0: only at the end")
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--print-every", type=int, default=10, help="without a progress bar")
    p.add_argument("--no-progress", action="store_true", help="plain prints, no progress bar")
    p.add_argument("--compare-local", action="store_true",
                   help="also train with muond.LocalOptimizer (in-process torch) and print both "
                        "loss curves side by side")
    p.add_argument("--sample", type=int, default=200, help="characters to sample at the end")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--metrics-out", metavar="FILE", help="write losses and timings as JSON")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.data:
        text = Path(args.data).read_text(encoding="utf-8", errors="replace")
    else:
        text = Grammar(args.seed).text(args.corpus_chars)
    data = CharData(text, args.seed, args.context)
    print(f"corpus: {len(text):,} characters, vocabulary of {data.vocab_size}"
          + ("" if args.data else f"; e.g. \"{text[:90]}...\""))

    daemon = SpawnedDaemon(args.spawn_daemon, args.daemon_backend) if args.spawn_daemon else None
    endpoint = daemon.endpoint if daemon else args.endpoint
    try:
        def remote(groups):
            return muond.RemoteOptimizer(groups, endpoint=endpoint, session=args.session,
                                         wire_dtype=args.wire_dtype)
        print(f"muond daemon at {endpoint}, gradients as {args.wire_dtype} on the wire")
        model, results = train("muond", data, args, remote)
    except muond.MuondError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        if daemon:
            daemon.stop()
    metrics = {"muond": results}
    if args.compare_local:
        _, local = train("local", data, args, muond.LocalOptimizer)
        metrics["local"] = local
        print_side_by_side(results, local, max(1, args.steps // 15))
    if args.sample:
        prompt = torch.tensor([[data.stoi.get(c, 0) for c in "The "]])
        print("sample:", data.decode(model.sample(prompt, args.sample, 0.8, args.seed)))
    if args.metrics_out:
        Path(args.metrics_out).write_text(json.dumps(metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
