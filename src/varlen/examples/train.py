"""Train a small transformer on jagged batches, then race it against the same model on padded batches.

Run ``python -m varlen.examples.train`` (``make demo``); ``--help`` lists the options that scale it up.

The task is generated here (no download). Each example is a BOS token followed by 1 to ``--max-len``
symbols drawn from ``--vocab`` (lengths uniform), and the target of every symbol is how many times it
occurs in its own sequence (capped at ``--classes``). Solving it takes attention over the whole sequence
(the BOS token gives the softmax a fixed reference to count against) and nothing else: a token that
attended to another sequence's tokens, or to padding, would count wrong.
The model is ``varlen.nn.TransformerEncoderLayer`` layers over ``varlen.JaggedTensor`` batches: no
padding anywhere, every row of every tensor is a real token.

At the end, the trained weights are copied into the same network built from ``torch.nn`` layers that
take padded batches (``src_key_padding_mask``), as a padded training loop would use, and both run forward
and backward on the same batches, in the same precision: real tokens per second and peak memory, side by
side. The run stops with an error if the two networks' logits disagree.

``--precision`` picks how both train: ``fp32`` (full float32 matmuls), ``tf32`` (float32 with TF32 matrix
units), ``bf16`` / ``fp16`` (``torch.autocast`` over float32 weights; fp16 with a gradient scaler). The
default is bf16 on CUDA and fp32 on the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import varlen
from varlen.nn import TransformerEncoderLayer

# ------------------------------------------------------------------------------------------- data
IGNORE = -100  # target of the BOS tokens and of padding: no loss


@dataclasses.dataclass
class Batch:
    """One batch in both layouts: jagged for varlen, padded for the torch baseline."""

    tokens: varlen.JaggedTensor  # (B, j) token ids
    targets: torch.Tensor  # (total,) class of each token: its count in its sequence, minus 1 (BOS: IGNORE)
    padded_tokens: torch.Tensor  # (B, max_len), 0 past each sequence's end
    padding_mask: torch.Tensor  # (B, max_len) bool, True at padding (torch's src_key_padding_mask)
    padded_targets: torch.Tensor  # (B, max_len), IGNORE at padding

    @property
    def n_tokens(self) -> int:
        """Real tokens (BOS included): the rows the model computes."""
        return self.tokens.total


def make_batch(gen: torch.Generator, batch_size: int, max_len: int, vocab: int, classes: int,
               device: torch.device) -> Batch:
    """Sequences of ``1..max_len`` random symbols, each after a BOS token (id ``vocab``, target ignored)."""
    lengths = torch.randint(1, max_len + 1, (batch_size,), generator=gen) + 1
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    starts = offsets[:-1]
    tokens = torch.randint(0, vocab, (int(offsets[-1]),), generator=gen)
    tokens[starts] = vocab
    seq = torch.repeat_interleave(torch.arange(batch_size), lengths)
    key = seq * (vocab + 1) + tokens  # (sequence, symbol) pairs: one bincount counts every sequence at once
    counts = torch.bincount(key, minlength=batch_size * (vocab + 1))[key]
    targets = counts.clamp(max=classes) - 1
    targets[starts] = IGNORE
    jagged = varlen.JaggedTensor(tokens, offsets.to(torch.int32), int(lengths.max()))
    padding_mask = torch.arange(jagged.max_len)[None, :] >= lengths[:, None]
    return Batch(tokens=jagged.to(device), targets=targets.to(device),
                 padded_tokens=jagged.to_padded(0).to(device), padding_mask=padding_mask.to(device),
                 padded_targets=jagged.with_values(targets).to_padded(IGNORE).to(device))


# --------------------------------------------------------------------------------------- precision
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def set_matmul_precision(precision: str) -> None:
    """float32 matmuls (torch's and varlen's kernels alike): exact for fp32, TF32 matrix units for tf32.
    Autocast runs its matmuls in bf16/fp16 and keeps the rest exact."""
    torch.set_float32_matmul_precision("high" if precision == "tf32" else "highest")


def autocast(precision: str, device: torch.device):
    """The context a forward pass runs in: ``torch.autocast`` for bf16/fp16, nothing otherwise."""
    if precision in AUTOCAST_DTYPES:
        return torch.autocast(device.type, dtype=AUTOCAST_DTYPES[precision])
    return contextlib.nullcontext()


# ------------------------------------------------------------------------------------------ models
class CountingTransformer(nn.Module):
    """Token embedding, pre-norm encoder layers, a per-token classifier; jagged batches in and out.

    No position embedding: the task doesn't depend on order.
    """

    def __init__(self, vocab: int, classes: int, d_model: int, nhead: int, layers: int, dim_feedforward: int,
                 dropout: float):
        super().__init__()
        self.embed = nn.Embedding(vocab + 1, d_model)  # the symbols and BOS
        self.layers = nn.ModuleList(
            TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout, activation="gelu", norm_first=True)
            for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, classes)

    def forward(self, tokens: varlen.JaggedTensor) -> torch.Tensor:
        """``(total, classes)`` logits, one row per real token."""
        x = tokens.with_values(self.embed(tokens.values))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x.values))


class PaddedTwin(nn.Module):
    """The same network from ``torch.nn`` layers on padded batches, with a copy of ``model``'s weights."""

    def __init__(self, model: CountingTransformer):
        super().__init__()
        self.embed, self.norm, self.head = (copy.deepcopy(m) for m in (model.embed, model.norm, model.head))
        self.layers = nn.ModuleList()
        for ours in model.layers:
            attn = ours.self_attn
            theirs = nn.TransformerEncoderLayer(attn.embed_dim, attn.num_heads, ours.linear1.out_features,
                                                ours.dropout.p, activation="gelu", norm_first=True,
                                                batch_first=True, device=attn.in_proj_weight.device)
            theirs.load_state_dict(ours.state_dict())
            self.layers.append(theirs)

    def forward(self, tokens: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        """``(B, max_len, classes)`` logits; rows at padding are computed too, and ignored by the loss."""
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, src_key_padding_mask=padding_mask)
        return self.head(self.norm(x))


def jagged_loss(model, batch: Batch, precision: str) -> torch.Tensor:
    with autocast(precision, batch.targets.device):
        return F.cross_entropy(model(batch.tokens), batch.targets, ignore_index=IGNORE)


def padded_loss(model, batch: Batch, precision: str) -> torch.Tensor:
    with autocast(precision, batch.targets.device):
        logits = model(batch.padded_tokens, batch.padding_mask)
        return F.cross_entropy(logits.flatten(0, 1), batch.padded_targets.flatten(), ignore_index=IGNORE)


# ------------------------------------------------------------------------------------------ output
class Progress:
    """A one-line progress bar on a terminal; on a pipe (logs, CI) only the lines given to :meth:`log`."""

    def __init__(self, total: int, stream=sys.stdout, width: int = 28):
        self.total, self.stream, self.width = total, stream, width
        self.tty = stream.isatty()
        self.start = time.perf_counter()

    def update(self, step: int, text: str = "") -> None:
        if not self.tty:
            return
        elapsed = time.perf_counter() - self.start
        filled = self.width * step // self.total
        eta = elapsed / step * (self.total - step) if step else 0.0
        self.stream.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {step}/{self.total} {text} "
                          f"{elapsed:.0f}s<{eta:.0f}s\033[K")
        self.stream.flush()

    def log(self, line: str) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
        print(line, file=self.stream, flush=True)


def table(rows: list[list[str]]) -> str:
    """A markdown table; the first row is the header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"
    return "\n".join([line(rows[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows[1:])])


# ----------------------------------------------------------------------------------------- training
def lr_at(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over the first 5% of the steps, then cosine decay to 10% of the peak."""
    warm = max(1, steps // 20)
    if step < warm:
        return peak * (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def evaluate(model, batches: list[Batch], precision: str) -> tuple[float, float]:
    """Token accuracy and sequence accuracy (every token right) on held-out batches, BOS left out."""
    was_training = model.training
    model.eval()
    right = total = seqs_right = seqs = 0
    for batch in batches:
        scored = batch.targets != IGNORE
        with autocast(precision, batch.targets.device):
            predicted = model(batch.tokens).argmax(-1)
        miss = ((predicted != batch.targets) & scored).float()
        right += scored.sum() - miss.sum()
        total += scored.sum()
        misses = varlen.sum(batch.tokens.with_values(miss[:, None]), 1)[:, 0]
        seqs_right += (misses == 0).sum()
        seqs += batch.tokens.batch_size
    model.train(was_training)
    return float(right / total), float(seqs_right) / seqs


def train(args, model: CountingTransformer, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(args.seed + 1)
    held_out = [make_batch(gen, args.batch_size, args.max_len, args.vocab, args.classes, device) for _ in range(4)]
    step_fn = torch.compile(model, fullgraph=True, dynamic=True) if args.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    # fp16 gradients underflow without loss scaling; the scaler is a no-op for the other precisions.
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")
    progress = Progress(args.steps)
    report_every = max(1, args.steps // 10)
    acc, seq_acc = evaluate(model, held_out, args.precision)
    progress.log(f"step {0:>5}  loss      -  token accuracy {acc:6.1%}  sequence accuracy {seq_acc:6.1%}")
    running, seen, tokens, start = torch.zeros((), device=device), 0, 0, time.perf_counter()
    model.train()
    for step in range(1, args.steps + 1):
        batch = make_batch(gen, args.batch_size, args.max_len, args.vocab, args.classes, device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step - 1, args.steps, args.lr)
        loss = jagged_loss(step_fn, batch, args.precision)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        running += loss.detach()
        seen += 1
        tokens += batch.n_tokens
        progress.update(step)
        if step % report_every == 0 or step == args.steps:
            acc, seq_acc = evaluate(model, held_out, args.precision)
            rate = tokens / (time.perf_counter() - start)
            progress.log(f"step {step:>5}  loss {float(running) / seen:6.3f}  token accuracy {acc:6.1%}  "
                         f"sequence accuracy {seq_acc:6.1%}  ({rate:,.0f} tokens/s)")
            running.zero_()
            seen = 0


# --------------------------------------------------------------------------------------- benchmark
MEMORY_MEANING = {
    "cuda": "peak CUDA memory allocated by torch during the steps, above the level before them",
    "cpu": "peak CPU memory held by torch tensors during the steps, above the level before them (the torch "
           "profiler's allocation events, in a separate untimed pass)",
}


def _step(loss_fn, model, batch: Batch, precision: str) -> None:
    loss_fn(model, batch, precision).backward()
    model.zero_grad(set_to_none=True)


def _timed(loss_fn, model, batches: list[Batch], device: torch.device, precision: str,
           warm_up: bool = True) -> tuple[float, float | None]:
    """Seconds for forward + backward over ``batches``; on CUDA also the peak memory in MiB (None on the CPU:
    see :func:`_cpu_peak_memory`). With ``warm_up``, untimed steps first: on CUDA every batch once, so that every
    kernel (and, with --compile, every graph) is compiled before the clock starts; on the CPU one step."""
    cuda = device.type == "cuda"
    warm_up_batches = (batches if cuda else batches[:1]) if warm_up else []
    for batch in warm_up_batches:
        _step(loss_fn, model, batch, precision)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    for batch in batches:
        _step(loss_fn, model, batch, precision)
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    return seconds, (torch.cuda.max_memory_allocated(device) - base) / 2**20 if cuda else None


@contextlib.contextmanager
def _quiet_stderr():
    """Silence the process's stderr (file descriptor 2): the profiler's C++ side logs lines of its own there."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _cpu_peak_memory(loss_fn, model, batches: list[Batch], precision: str) -> float | None:
    """Peak MiB of torch CPU tensors over the steps: the running sum of the profiler's allocation (+) and
    free (-) events, whose maximum is the peak above the level at the start. None if the profiler lacks them."""
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for batch in batches:
            _step(loss_fn, model, batch, precision)
    try:
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    except AttributeError:  # the profiler's results changed shape
        return None
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak / 2**20


# How far the two networks' logits may drift apart, relative to the largest logit, in each precision: they
# compute the same function in different orders (the padded one also over padding, masked).
DRIFT_TOLERANCE = {"fp32": 1e-4, "tf32": 1e-2, "fp16": 1e-2, "bf16": 5e-2}


def logit_drift(model: CountingTransformer, twin: nn.Module, batch: Batch, precision: str) -> float:
    """Max |logit difference| between the jagged model and its padded twin on the real tokens, relative to
    the largest |logit|. In evaluation mode: with ``--dropout`` the two would draw different masks."""
    modes = (model.training, twin.training)
    model.eval()
    twin.eval()
    try:
        with torch.no_grad(), autocast(precision, batch.targets.device):
            ours = model(batch.tokens).float()
            theirs = twin(batch.padded_tokens, batch.padding_mask)[~batch.padding_mask].float()
    finally:
        model.train(modes[0])
        twin.train(modes[1])
    return float((ours - theirs).abs().max() / theirs.abs().max().clamp(min=1e-6))


def benchmark(args, model: CountingTransformer, device: torch.device) -> None:
    twin = PaddedTwin(model)
    gen = torch.Generator().manual_seed(args.seed + 2)
    batches = [make_batch(gen, args.batch_size, args.max_len, args.vocab, args.classes, device)
               for _ in range(args.bench_steps)]
    drift = logit_drift(model, twin, batches[0], args.precision)
    if not drift <= DRIFT_TOLERANCE[args.precision]:
        raise SystemExit(f"error: the jagged model and its padded twin disagree: max |logit difference| "
                         f"{drift:.2e} of the largest logit, above the {DRIFT_TOLERANCE[args.precision]:.0e} "
                         f"allowed in {args.precision}")
    jagged_model = torch.compile(model, fullgraph=True, dynamic=True) if args.compile else model
    padded_model = torch.compile(twin, dynamic=True) if args.compile else twin
    real = sum(b.n_tokens for b in batches)
    slots = sum(b.padded_tokens.numel() for b in batches)
    models = {"jagged: varlen": (jagged_loss, jagged_model),
              "padded: torch.nn + key padding mask": (padded_loss, padded_model)}
    # Rounds alternate the two models, and each model's median round is reported: a pass over the batches takes
    # about a second on a 2-core CPU, where one pass each read 1.32x to 1.55x between runs (median of 5: 1.45-1.48x).
    rounds = {name: [] for name in models}
    for i in range(args.bench_rounds):
        for name, (loss_fn, net) in models.items():
            rounds[name].append(_timed(loss_fn, net, batches, device, args.precision, warm_up=i == 0))
    rows = [["batches", "tokens/s (real tokens)", "step (ms)", "peak memory (MiB)"]]
    results = {}
    for name, (loss_fn, net) in models.items():
        seconds = statistics.median(seconds for seconds, _ in rounds[name])
        peak = (_cpu_peak_memory(loss_fn, net, batches, args.precision) if device.type == "cpu" else
                max(peak for _, peak in rounds[name]))
        results[name] = (seconds, peak)
        rows.append([name, f"{real / seconds:,.0f}", f"{1000 * seconds / len(batches):.1f}",
                     "n/a" if peak is None else f"{peak:,.1f}"])
    (s_j, m_j), (s_p, m_p) = results.values()
    print(f"\nSame weights, same {len(batches)} batches ({real:,} real tokens; padded to {slots:,} slots, "
          f"{1 - real / slots:.0%} padding), forward + backward on {device.type} in {args.precision}"
          f"{', compiled' if args.compile else ''}; the median of {args.bench_rounds} rounds, alternated:")
    print(table(rows))
    memory = "" if m_j is None or m_p is None or m_p <= 0 else f", peak memory {m_j / m_p:.2f}x"
    print(f"jagged / padded: throughput {s_p / s_j:.2f}x{memory}. Max |logit difference| between the two on "
          f"real tokens: {drift:.1e} of the largest logit")
    print(f"memory: {MEMORY_MEANING['cuda' if device.type == 'cuda' else 'cpu']}.")
    if device.type == "cpu" and args.dropout > 0:
        print("note: torch's fused CPU attention kernel has no dropout, so neither model runs it: the padded model "
              "takes SDPA's math path over the whole padded batch, varlen its chunked path on buckets of similar "
              "lengths (the dropout mask drawn in tensor ops). On CUDA varlen runs its Triton kernels.")
    elif device.type == "cpu":
        print("note: on the CPU both models' attention runs torch's fused CPU kernel; varlen calls it on buckets "
              "of similar lengths instead of the whole padded batch. On CUDA varlen runs its Triton kernels.")


# -------------------------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m varlen.examples.train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=500, help="training steps")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per batch")
    p.add_argument("--max-len", type=int, default=64, help="longest sequence (lengths are uniform in 1..max)")
    p.add_argument("--vocab", type=int, default=16, help="symbols")
    p.add_argument("--classes", type=int, default=8, help="counts above this are capped")
    p.add_argument("--d-model", type=int, default=64, help="features per token")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--layers", type=int, default=2, help="encoder layers")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout (attention, feed-forward, residual)")
    p.add_argument("--lr", type=float, default=1e-2, help="peak learning rate (AdamW)")
    p.add_argument("--bench-steps", type=int, default=20, help="batches timed in the final comparison")
    p.add_argument("--bench-rounds", type=int, default=5,
                   help="passes over those batches, the two models alternated (the median pass is reported)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda[:i]")
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="fp32, tf32, or bf16/fp16 autocast (default: bf16 on CUDA, fp32 on the CPU)")
    p.add_argument("--compile", action="store_true", help="torch.compile both models (dynamic shapes)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (the default model's ops are too small to gain from more, and extra "
                        "threads stall when other processes share the cores)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "max_len", "vocab", "classes", "d_model", "heads", "layers", "bench_steps",
                 "bench_rounds", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.d_model % args.heads:
        p.error(f"--d-model {args.d_model} must be a multiple of --heads {args.heads}")
    if args.precision is None:
        args.precision = "bf16" if torch.device(args.device).type == "cuda" else "fp32"
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    set_matmul_precision(args.precision)
    torch.manual_seed(args.seed)
    model = CountingTransformer(args.vocab, args.classes, args.d_model, args.heads, args.layers, 4 * args.d_model,
                                args.dropout).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    where = (f"{device.type} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else
             f"cpu (torch threads: {torch.get_num_threads()})")
    print(f"varlen {varlen.__version__}, torch {torch.__version__}, {where}; {n_params:,} parameters "
          f"(layers {args.layers}, d_model {args.d_model}, heads {args.heads}), precision {args.precision}")
    print(f"task: count each token's occurrences in its own sequence ({args.vocab} symbols, lengths "
          f"1..{args.max_len} after a BOS token, {args.batch_size} sequences per batch)")
    train(args, model, device)
    benchmark(args, model, device)


if __name__ == "__main__":
    main()
