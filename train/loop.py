"""The training run: tokenizer and data, model, then up to two phases on a DeepSpeed engine:
``dense`` (``dense_steps`` steps of the dense model) and ``nosa`` (convert, then ``steps`` steps).
Steps are counted globally across phases; eval and checkpoints happen every N steps and at the
last step of each phase. Reads top to bottom."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from nosa.train import checkpoint, synthetic
from nosa.train.config import TrainConfig
from nosa.train.data import batch_at, build_rows, offline_env, prepare_synthetic
from nosa.train.distill import fit_eviction_heads
from nosa.train.engine import ds_config, init_distributed, initialize, zero_stage
from nosa.train.loss import weighted_loss
from nosa.train.metrics import evaluate, selection_stats
from nosa.train.model import build_model, eviction_scales, is_nosa, load_model, param_groups, to_nosa
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
        nosa_cfg = cfg.nosa_config  # facts outside the sinks and the question's local window
        data_dir = prepare_synthetic(
            cfg.data.synthetic, cfg.seq_len, cfg.tokenizer.vocab_size, tok_path, rank, cfg.seq_lens,
            head=nosa_cfg.sink_blocks * nosa_cfg.block_size, tail=nosa_cfg.window_blocks * nosa_cfg.block_size,
        )
        tok_path = tok_path or os.path.join(data_dir, "tokenizer")
        train_files = {n: [synthetic.train_file(data_dir, n, cfg.seq_len)] for n in cfg.seq_lens}
        eval_files = cfg.data.eval_files or [os.path.join(data_dir, "heldout.jsonl")]
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
    tokens_per_step = cfg.micro_batch * cfg.grad_accum * world * cfg.seq_len
    params = sum(p.numel() for p in model.parameters())
    print0(
        f"model {type(model).__name__}: {params / 1e6:.2f}M params; {len(rows)} train rows of "
        f"{cfg.seq_len} tokens; {tokens_per_step} tokens/step; world {world}; device {device}"
    )
    logger = Logger(cfg.out_dir, cfg.to_dict(), cfg.wandb.mode, cfg.wandb.project, cfg.wandb.name, cfg.wandb.dir, rank)

    # ---- phases ---------------------------------------------------------------------------------
    last: dict = {}
    phases = [("dense", 0, cfg.dense_steps), ("nosa", cfg.dense_steps, cfg.total_steps)]
    for phase, start, end in phases:
        if end <= max(start, state["step"]):
            continue
        if phase == "nosa" and not is_nosa(model.config):
            to_nosa(model, cfg.nosa_config)
            print0(f"converted to NOSA: {cfg.nosa_config}")
            if cfg.distill_rows:
                fitted = fit_eviction_heads(model, rows.select(range(min(cfg.distill_rows, len(rows)))),
                                            cfg.nosa_config, cfg.distill_steps, cfg.distill_lr,
                                            cfg.distill_scale, cfg.data.answer_weight, print0)
                logger.log(fitted, step=state["step"])
            if eval_rows is not None:  # what the fine-tune starts from: the converted model, A set
                start_eval = {f"converted/{k.split('/', 1)[1]}": v
                              for k, v in evaluate(model, eval_rows, cfg.eval_examples).items()}
                print0("converted model: " + ", ".join(f"{k} {v:.4f}" for k, v in start_eval.items()))
                logger.log(start_eval, step=state["step"])
        lr = cfg.optim.lr if phase == "nosa" else (cfg.dense_lr or cfg.optim.lr)
        freeze = cfg.freeze_base and phase == "nosa"
        groups = param_groups(model, lr, cfg.optim.lr_evict, cfg.optim.weight_decay, freeze)
        engine = initialize(
            model, groups, dscfg, cfg.optim.betas, cfg.optim.warmup_steps, end - start, cfg.optim.min_lr_ratio
        )
        if resume and state["step"] > start:
            checkpoint.load_engine_state(engine, resume)
        last = _train_phase(
            cfg,
            phase,
            engine,
            tokenizer,
            rows_at,
            eval_rows,
            state,
            end,
            rank,
            world,
            tokens_per_step,
            zero_stage(dscfg),
            logger,
            print0,
        )
    logger.finish()
    return {"metrics": last, "model": model}


def _train_phase(
    cfg, phase, engine, tokenizer, rows_at, eval_rows, state, end, rank, world, tokens_per_step, stage, logger, print0
) -> dict:
    from tqdm import tqdm

    model = engine.module
    device = engine.device
    bar = tqdm(total=end, initial=state["step"], desc=phase, disable=rank != 0 or not cfg.progress, dynamic_ncols=True)
    metrics: dict = {}
    while state["step"] < end:
        step = state["step"]
        lrs = {f"lr/{g.get('name', 'all')}": g["lr"] for g in engine.optimizer.param_groups}
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        length, micro_batch = cfg.stage_at(step)
        rows = rows_at[length]
        for micro in range(cfg.grad_accum):
            batch = batch_at(rows, step, micro, cfg.grad_accum, micro_batch, rank, world, cfg.seed)
            # position_ids restart per packed document and, with no cache, give both the dense and
            # the NOSA attention a per-document mask (nosa.train.data)
            out = engine(input_ids=batch["input_ids"].to(device), position_ids=batch["position_ids"].to(device),
                         use_cache=False)
            micro_loss = weighted_loss(out.logits, batch["labels"].to(device), batch["answers"].to(device),
                                       cfg.data.answer_weight)
            engine.backward(micro_loss)
            engine.step()
            loss_sum += micro_loss.detach().float()
        loss = loss_sum / cfg.grad_accum
        if world > 1:
            dist.all_reduce(loss)
            loss /= world
        dt = time.perf_counter() - t0
        state["step"] = step + 1
        state["tokens"] = state.get("tokens", 0) + tokens_per_step
        done = state["step"]
        last_step = done == end
        metrics = {
            "train/loss": float(loss),
            "train/tokens_per_s": tokens_per_step / dt,
            "train/tokens": state["tokens"],
            "train/phase": int(phase == "nosa"),
            **lrs,
        }
        if not torch.isfinite(loss):
            raise FloatingPointError(f"step {done}: loss is {float(loss)}")
        if is_nosa(model.config):
            for layer, a in eviction_scales(model).items():
                metrics[f"evict_A/layer{layer}"] = float(a.mean())
                metrics[f"evict_A_absmax/layer{layer}"] = float(a.abs().max())
        if eval_rows is not None and (last_step or (cfg.eval_every and done % cfg.eval_every == 0)):
            metrics.update(evaluate(model, eval_rows, cfg.eval_examples))
        stats_due = cfg.stats_every and done % cfg.stats_every == 0
        if is_nosa(model.config) and (last_step or stats_due or (cfg.eval_every and done % cfg.eval_every == 0)):
            sample = (eval_rows or rows_at[cfg.seq_len])[0]
            metrics.update(selection_stats(model, sample["input_ids"], cfg.nosa_config,
                                           position_ids=sample["position_ids"]))
        if done % cfg.log_every == 0 or last_step or any(k.startswith("eval/") for k in metrics):
            logger.log(metrics, step=done)
        bar.set_postfix(loss=f"{float(loss):.4f}", acc=metrics.get("eval/acc", float("nan")))
        bar.update(1)
        if last_step or (cfg.save_every and done % cfg.save_every == 0):
            path = checkpoint.save(
                engine,
                tokenizer,
                cfg.to_dict(),
                cfg.out_dir,
                done,
                dict(state, phase=phase),
                cfg.keep_checkpoints,
                stage,
            )
            if last_step:
                checkpoint.mark_keep(path, phase)
            print0(f"\nsaved {path}")
    bar.close()
    return metrics
