"""The training run: tokenizer and data, model, then up to two phases, each a ``Phase`` on its own
DeepSpeed engine: ``dense`` (``dense_steps`` steps of the dense model) and ``nosa`` (convert, then
``steps`` steps). Steps are counted globally across phases; eval and checkpoints happen every N
steps and at the last step of each phase. Reads top to bottom: ``run`` sets up and prints the
derived numbers, ``Phase.run`` is the step loop.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from tqdm import tqdm

import nosa
from nosa.hf import capture_attention_inputs
from nosa.train import checkpoint, synthetic
from nosa.train.config import TrainConfig
from nosa.train.data import batch_at, build_rows, offline_env, prepare_ruler, prepare_synthetic
from nosa.train.distill import fit_eviction_heads
from nosa.train.engine import ds_config, init_distributed, initialize, zero_stage
from nosa.train.loss import kl_to_teacher, weighted_loss
from nosa.train.metrics import evaluate, selection_stats
from nosa.train.model import build_model, eviction_scales, is_nosa, load_model, param_groups
from nosa.train.select_loss import selection_loss
from nosa.train.tokenizer import load_tokenizer
from nosa.wandb_log import Logger


def run(cfg: TrainConfig) -> dict:
    """Train; returns {"metrics": the last step's metrics, "model": the trained module}."""
    offline_env()
    rank, world, device = init_distributed()

    def print0(*args):
        if rank == 0:
            print(*args, flush=True)

    # ---- resume point ---------------------------------------------------------------------------
    resume = checkpoint.latest(cfg.out_dir) if cfg.resume == "auto" else cfg.resume
    state = checkpoint.read_state(resume) if resume else {"step": 0, "tokens": 0}
    if resume:
        print0(f"resuming from {resume} (step {state['step']})")
    dscfg = ds_config(cfg.deepspeed, cfg.micro_batch, cfg.grad_accum, cfg.optim.grad_clip)

    # ---- tokenizer and data ---------------------------------------------------------------------
    tok_path = cfg.tokenizer.path or cfg.model.path
    if cfg.data.synthetic is not None:
        nosa_cfg = cfg.nosa  # facts outside the sinks and the question's local window
        data_dir = prepare_synthetic(
            cfg.data.synthetic, cfg.seq_len, cfg.tokenizer.vocab_size, tok_path, rank, cfg.seq_lens,
            head=nosa_cfg.sink_blocks * nosa_cfg.block_size, tail=nosa_cfg.window_blocks * nosa_cfg.block_size,
        )
        tok_path = tok_path or os.path.join(data_dir, "tokenizer")
        train_files = {n: [synthetic.train_file(data_dir, n, cfg.seq_len)] for n in cfg.seq_lens}
        eval_files = cfg.data.eval_files or [os.path.join(data_dir, "heldout.jsonl")]
    elif cfg.data.ruler is not None:
        data_dir = prepare_ruler(cfg.data.ruler, cfg.seq_len, tok_path, rank)
        train_files = {cfg.seq_len: [os.path.join(data_dir, "train.jsonl")]}
        eval_files = cfg.data.eval_files or ([os.path.join(data_dir, "heldout.jsonl")]
                                             if cfg.data.ruler.heldout_examples else [])
    else:
        train_files = {n: cfg.data.train_files for n in cfg.seq_lens}
        eval_files = cfg.data.eval_files
    if tok_path is None:
        raise ValueError("tokenizer: with data.train_files and model.build, set tokenizer.path")
    tokenizer = load_tokenizer(resume or tok_path)
    rows_at = {  # rows by length: the curriculum's stages and seq_len (cfg.stage_at)
        n: build_rows(
            files, tokenizer, n, cfg.data.text_field, cfg.data.num_proc, targets_only=cfg.data.loss_on == "targets"
        )
        for n, files in train_files.items()
    }
    rows = rows_at[cfg.seq_len]
    eval_rows = build_rows(eval_files, tokenizer, cfg.seq_len, cfg.data.text_field) if eval_files else None

    # ---- model ----------------------------------------------------------------------------------
    torch.manual_seed(cfg.seed)
    if resume:
        model = load_model(resume)
    elif cfg.model.path:
        model = load_model(cfg.model.path)
    else:
        model = build_model(cfg.model.build, tokenizer)
    if is_nosa(model.config) and state["step"] < cfg.dense_steps:
        raise ValueError(f"dense_steps={cfg.dense_steps} but the model is already NOSA; set dense_steps=0")
    teacher = None  # self-distillation: the pretrained model as it was, frozen (also when resuming)
    if cfg.data.kl_weight:
        teacher = load_model(cfg.model.path).eval().requires_grad_(False).to(device)
        if is_nosa(teacher.config):
            raise ValueError(f"data.kl_weight: the teacher {cfg.model.path} is a NOSA checkpoint; "
                             "self-distillation starts from a dense model")

    # ---- derived numbers ------------------------------------------------------------------------
    tokens_per_step = cfg.micro_batch * cfg.grad_accum * world * cfg.seq_len  # every curriculum stage too
    stage = zero_stage(dscfg)
    phases = [("dense", 0, cfg.dense_steps), ("nosa", cfg.dense_steps, cfg.total_steps)]
    params = sum(p.numel() for p in model.parameters())
    print0(
        f"model {type(model).__name__}: {params / 1e6:.2f}M params; {len(rows)} train rows of "
        f"{cfg.seq_len} tokens; {tokens_per_step} tokens/step; world {world}; device {device}; ZeRO stage {stage}; "
        + ", ".join([f"{name} steps {start + 1}-{end}" for name, start, end in phases if end > start]
                    + (["the eviction-head fit only (steps: 0)"] if cfg.fit_only else []))
    )
    logger = Logger(cfg.out_dir, cfg.to_dict(), cfg.wandb.mode, cfg.wandb.project, cfg.wandb.name, cfg.wandb.dir, rank)

    # ---- phases ---------------------------------------------------------------------------------
    last: dict = {}
    for name, start, end in phases:
        fit_only = name == "nosa" and cfg.fit_only and not is_nosa(model.config)  # no steps, the fit alone
        if end <= max(start, state["step"]) and not fit_only:  # empty, or done before the resume point
            continue
        if name == "nosa" and not is_nosa(model.config):
            nosa.convert(model, cfg.nosa)  # A = 0: the converted model starts as training-free selection
            print0(f"converted to NOSA: {cfg.nosa}")
            if cfg.distill.rows:
                fitted = fit_eviction_heads(model, rows.select(range(min(cfg.distill.rows, len(rows)))), cfg.nosa,
                                            cfg.distill, cfg.data.answer_weight, print0,
                                            progress=rank == 0 and cfg.progress)
                logger.log(fitted, step=state["step"])
                path = checkpoint.save_model(model, tokenizer, cfg.to_dict(), os.path.join(cfg.out_dir, "fitted"))
                print0(f"saved {path} (the fitted model, before the fine-tune)")
            if eval_rows is not None:  # what the fine-tune starts from: the converted model, A set
                start_eval = {f"converted/{k.split('/', 1)[1]}": v
                              for k, v in evaluate(model, eval_rows, cfg.eval_examples).items()}
                print0("converted model: " + ", ".join(f"{k} {v:.4f}" for k, v in start_eval.items()))
                logger.log(start_eval, step=state["step"])
        if fit_only:
            last = fitted
            alias = checkpoint.link(path, "nosa")  # the path a server loads: the fitted model
            print0(f"linked {alias} -> fitted (steps: 0, the fit only)")
            continue
        lr = cfg.optim.lr if name == "nosa" else (cfg.dense_lr or cfg.optim.lr)
        freeze = cfg.freeze_base and name == "nosa"
        groups = param_groups(model, lr, cfg.optim.lr_evict, cfg.optim.weight_decay, freeze)
        engine = initialize(model, groups, dscfg, cfg.optim, end - start)
        if resume and state["step"] > start:  # resumed inside this phase: its optimizer and lr schedule
            checkpoint.load_engine_state(engine, resume)
        phase = Phase(
            name=name, end=end, engine=engine, cfg=cfg, rows_at=rows_at, eval_rows=eval_rows, tokenizer=tokenizer,
            logger=logger, print0=print0, state=state, rank=rank, world=world, tokens_per_step=tokens_per_step,
            zero_stage=stage, teacher=teacher,
        )
        last = phase.run()
    logger.finish()
    return {"metrics": last, "model": model}


@dataclass
class Phase:
    """One phase of the run on its own DeepSpeed engine: trains from ``state["step"]`` up to step
    ``end`` (steps counted across phases), evaluates, logs and saves when due."""

    name: str  # "dense" or "nosa"
    end: int
    engine: Any  # deepspeed.DeepSpeedEngine; engine.module is the model
    cfg: TrainConfig
    rows_at: dict[int, Any]  # training rows (datasets.Dataset) by row length: curriculum stages and seq_len
    eval_rows: Any | None  # held-out rows at seq_len, or None (no eval)
    tokenizer: Any  # saved with every checkpoint
    logger: Logger
    print0: Callable[..., None]  # print on rank 0
    state: dict  # the run's counters {"step": steps done, "tokens": tokens seen}, shared by both phases
    rank: int
    world: int
    tokens_per_step: int  # micro_batch * grad_accum * world * seq_len
    zero_stage: int  # a ZeRO-3 checkpoint gathers the partitioned parameters first
    teacher: Any | None = None  # the frozen dense model of data.kl_weight, or None
    parts: dict = field(default_factory=dict)  # the last step's loss terms (train/ce, train/kl)

    def run(self) -> dict:
        """Train up to ``end``; returns the last step's metrics."""
        cfg, state = self.cfg, self.state
        bar = tqdm(total=self.end, initial=state["step"], desc=self.name, disable=self.rank != 0 or not cfg.progress,
                   dynamic_ncols=True)
        metrics: dict = {}
        while state["step"] < self.end:
            # the learning rates this step trains with (the scheduler moves them in engine.step)
            lrs = {f"lr/{g.get('name', 'all')}": g["lr"] for g in self.engine.optimizer.param_groups}
            t0 = time.perf_counter()
            loss = self.step(state["step"])
            dt = time.perf_counter() - t0
            state["step"] += 1
            state["tokens"] += self.tokens_per_step
            done = state["step"]
            last_step = done == self.end
            if not torch.isfinite(loss):
                raise FloatingPointError(f"step {done}: loss is {float(loss)}")
            metrics = {
                "train/loss": float(loss),
                "train/tokens_per_s": self.tokens_per_step / dt,
                "train/tokens": state["tokens"],
                "train/phase": int(self.name == "nosa"),
                **self.parts,
                **lrs,
            }
            metrics.update(self.measure(done, last_step))
            if done % cfg.log_every == 0 or last_step or any(k.startswith("eval/") for k in metrics):
                self.logger.log(metrics, step=done)
            bar.set_postfix(loss=f"{float(loss):.4f}", acc=metrics.get("eval/acc", float("nan")))
            bar.update(1)
            if last_step or _every(cfg.save_every, done):
                self.save(done, last_step)
        bar.close()
        return metrics

    def step(self, step: int) -> torch.Tensor:
        """Optimizer step ``step`` (0-based): ``grad_accum`` micro batches of this rank, at the row
        length of the curriculum stage. Returns the loss averaged over micro batches and ranks, a
        scalar."""
        cfg, engine = self.cfg, self.engine
        device = engine.device
        length, micro_batch = cfg.stage_at(step)
        rows = self.rows_at[length]
        loss_sum = torch.zeros((), device=device)
        kl_sum = torch.zeros((), device=device)
        sel_sum = torch.zeros((), device=device)
        select = bool(cfg.data.select_weight) and is_nosa(engine.module.config)  # the selection loss: NOSA only
        for micro in range(cfg.grad_accum):
            batch = batch_at(rows, step, micro, cfg.grad_accum, micro_batch, self.rank, self.world, cfg.seed)
            # position_ids restart per packed document and, with no cache, give both the dense and
            # the NOSA attention a per-document mask (nosa.train.data)
            inputs = {"input_ids": batch["input_ids"].to(device), "position_ids": batch["position_ids"].to(device),
                      "use_cache": False}
            with capture_attention_inputs(engine.module, batch_row=None, detach=False) if select \
                    else contextlib.nullcontext() as captured:
                out = engine(**inputs)
            labels, answers = batch["labels"].to(device), batch["answers"].to(device)
            micro_loss = weighted_loss(out.logits, labels, answers, cfg.data.answer_weight)
            if select:
                rows_rng = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * cfg.grad_accum + micro)
                sel = selection_loss(captured, engine.module, labels, answers, inputs["position_ids"],
                                     cfg.data.answer_weight, cfg.data.select_rows, rows_rng)
                sel_sum += sel.detach()
                micro_loss = micro_loss + cfg.data.select_weight * sel
            if self.teacher is not None:
                with torch.no_grad():
                    teacher_logits = self.teacher(**inputs).logits
                kl = kl_to_teacher(out.logits, teacher_logits)
                kl_sum += kl.detach()
                micro_loss = micro_loss + cfg.data.kl_weight * kl
            engine.backward(micro_loss)
            engine.step()  # DeepSpeed applies the update only at the last micro batch of the step
            loss_sum += micro_loss.detach().float()
        loss = loss_sum / cfg.grad_accum
        parts = {}
        if select:
            parts["train/select"] = float(sel_sum) / cfg.grad_accum
        if self.teacher is not None:
            parts["train/kl"] = float(kl_sum) / cfg.grad_accum
        if parts:
            parts["train/ce"] = float(loss) - cfg.data.kl_weight * parts.get("train/kl", 0.0) \
                - cfg.data.select_weight * parts.get("train/select", 0.0)
        self.parts = parts
        if self.world > 1:
            dist.all_reduce(loss)
            loss /= self.world
        return loss

    def measure(self, done: int, last_step: bool) -> dict[str, float]:
        """What is due after ``done`` steps: A of every eviction head (every step of a NOSA model),
        the held-out eval (every ``eval_every`` steps and at the phase's last step) and the selection
        statistics of one row (with the eval, and every ``stats_every`` steps)."""
        cfg, model = self.cfg, self.engine.module
        nosa = is_nosa(model.config)
        out: dict[str, float] = {}
        if nosa:
            for layer, a in eviction_scales(model).items():
                out[f"evict_A/layer{layer}"] = float(a.mean())
                out[f"evict_A_absmax/layer{layer}"] = float(a.abs().max())
        eval_due = last_step or _every(cfg.eval_every, done)
        if self.eval_rows is not None and eval_due:
            out.update(evaluate(model, self.eval_rows, cfg.eval_examples))
        if nosa and (eval_due or _every(cfg.stats_every, done)):
            sample = (self.eval_rows if self.eval_rows is not None else self.rows_at[cfg.seq_len])[0]
            out.update(selection_stats(model, sample["input_ids"], cfg.nosa,
                                       position_ids=sample["position_ids"]))
        return out

    def save(self, done: int, last_step: bool) -> None:
        """A checkpoint after ``done`` steps; the phase's last one is kept and linked as
        ``<out_dir>/<phase name>``."""
        cfg = self.cfg
        path = checkpoint.save(self.engine, self.tokenizer, cfg.to_dict(), cfg.out_dir, done,
                               dict(self.state, phase=self.name), cfg.keep_checkpoints, self.zero_stage,
                               optimizer=cfg.save_optimizer)
        if last_step:
            checkpoint.mark_keep(path, self.name)
        self.print0(f"\nsaved {path}")


def _every(n: int, step: int) -> bool:
    """Whether a task set to run every ``n`` steps (0: never) is due after ``step`` steps."""
    return bool(n) and step % n == 0
