"""TrainConfig: the run configuration of ``python -m nosa.train``, read from YAML plus
``key=value`` overrides (dotted keys reach into sections: ``optim.lr=1e-3``).

Every key is known in advance: an unknown key, a wrong type or an inconsistent value raises
ValueError naming the field before anything is written to disk. The ``nosa`` section becomes a
NosaConfig once, at load (NosaConfig's own errors name the field), so one config flows from the
command line into the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

import yaml

from nosa.checkpoint_format import BY_NAME, MODEL_TYPES
from nosa.config import NosaConfig
from nosa.train.ruler import STYLES as RULER_STYLES
from nosa.train.ruler import TASKS as RULER_TASKS
from nosa.train.synthetic import TASKS

SUPPORTED_MODEL_TYPES = tuple(MODEL_TYPES)  # llama, qwen2, qwen3, gemma3_text


@dataclass
class ModelSection:
    path: str | None = None  # local HF checkpoint (dense or NOSA); None: build from `build`
    build: dict[str, Any] = field(default_factory=dict)  # e.g. {model_type: llama, hidden_size: 128}


@dataclass
class TokenizerSection:
    path: str | None = None  # None: the model path, or a locally trained byte-level BPE
    vocab_size: int = 512  # for the locally trained tokenizer


@dataclass
class SyntheticSection:
    dir: str = "data/synthetic"  # where the generated dataset (jsonl + meta.json) lives
    tasks: list[str] = field(default_factory=lambda: list(TASKS))  # tasks of nosa.train.synthetic.TASKS
    train_examples: int = 2000  # training examples generated (at seq_len and at each curriculum length)
    heldout_examples: int = 64  # held-out examples (heldout.jsonl, the eval rows)
    seed: int = 1234  # seed of the generated examples
    # Facts lie between the sink blocks and the local window of the question (nosa.sink_blocks and
    # nosa.window_blocks, in tokens), at this depth range of the span between (0: right after the
    # sinks, 1: right before the window).
    depth: list[float] = field(default_factory=lambda: [0.0, 1.0])


@dataclass
class RulerSection:
    """RULER-style rows over real prose (nosa.train.ruler: the long-context suite's tasks, answered),
    written with the model's tokenizer at seq_len: the haystacks of ``train.jsonl`` are the training
    documents of nosa.train.prose, those of ``heldout.jsonl`` (the eval rows) held-out ones."""

    dir: str = "data/ruler"  # where the rows (train.jsonl, heldout.jsonl, meta.json) are written
    tasks: list[str] = field(default_factory=lambda: list(RULER_TASKS))  # tasks of nosa.train.ruler.TASKS
    train_examples: int = 16  # per task
    heldout_examples: int = 1  # per task
    seed: int = 1  # seed of the written examples
    style: str = "suite"  # "suite": the suite's phrasings; "train": phrasings no benchmark uses (nosa.train.ruler)
    prose_rows: int = 0  # rows of plain training prose beside the tasks, every token a target


@dataclass
class DataSection:
    synthetic: SyntheticSection | None = None  # None: use `ruler` or `train_files`
    ruler: RulerSection | None = None  # None: use `synthetic` or `train_files`
    train_files: list[str] = field(default_factory=list)  # local .jsonl/.json/.parquet/.txt
    eval_files: list[str] = field(default_factory=list)  # held-out files (default: the generated heldout.jsonl)
    text_field: str = "text"  # the text column of train_files and eval_files
    loss_on: str = "all"  # "all" tokens or only the answer "targets" (examples with targets spans)
    # weight of an answer token against any other labelled token in the loss (1: the plain mean)
    answer_weight: float = 1.0
    # Self-distillation beside the token loss: the weight of the KL divergence from the frozen
    # starting model (model.path) to the trained one, per next-token distribution, averaged over
    # every position of the row (0: off). It keeps what the model knew while it learns the task.
    kl_weight: float = 0.0
    # The selection loss (nosa.train.select_loss), NOSA phase only: the weight of KL(dense block
    # attention || query-aware block score) over the candidate blocks, at select_rows rows per row
    # of the micro batch (answer rows first). 0: off. It trains what the query-aware part picks with.
    select_weight: float = 0.0
    select_rows: int = 64  # rows of each micro batch row the selection loss is taken at (answer rows first)
    num_proc: int = 1  # processes that tokenize the files (datasets.map)


@dataclass
class OptimSection:
    lr: float = 3e-4  # everything but the eviction heads
    lr_evict: float = 1e-3  # eviction heads (W, b, A)
    weight_decay: float = 0.0  # AdamW weight decay
    warmup_steps: int = 10  # linear warmup steps at the start of each phase
    min_lr_ratio: float = 0.1  # cosine decay floor
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW betas
    grad_clip: float = 1.0  # gradient norm clipping (DeepSpeed's gradient_clipping where that is "auto")


@dataclass
class WandbSection:
    mode: str | None = None  # None: $WANDB_MODE or "offline"; "online" needs a key; "disabled"
    project: str = "nosa"  # W&B project
    name: str | None = None  # W&B run name (None: W&B picks one)
    dir: str | None = None  # default: <out_dir>


@dataclass
class DistillSection:
    """Before the NOSA fine-tune, fit the eviction heads to the dense attention (nosa.train.distill)."""

    rows: int = 0  # training rows to fit on (0: no fit, the heads start at A = 0)
    steps: int = 1000  # Adam steps of each layer's fit
    lr: float = 3e-2  # the fit's learning rate
    scale: float = 0.1  # A of every eviction head after the fit
    # the window ranking term (nosa.train.distill.WindowRank): its weight beside the token loss (0: off)
    rank_weight: float = 0.0
    # its softmax temperature, in units of the window mean of softplus(W v + b)
    rank_tau: float = 0.02


@dataclass
class TrainConfig:
    out_dir: str = "runs/default"  # checkpoints, metrics.jsonl and the W&B run go here
    seed: int = 0  # seeds the model's initialisation and the order of the training rows
    seq_len: int = 2048  # tokens per training row
    micro_batch: int = 1  # rows per micro batch and rank (at seq_len)
    grad_accum: int = 1  # micro batches per optimizer step
    dense_steps: int = 0  # dense training before conversion (0 for a pretrained dense LM)
    # Shorter rows first: [[steps, seq_len], ...] at the start of the dense phase, each stage with
    # micro_batch * seq_len / its seq_len rows per micro step (the same tokens per step); the rest
    # of the dense phase and the NOSA phase train at seq_len. Retrieval emerges after a plateau
    # that grows with the square of the length, so short rows first make it emerge sooner.
    curriculum: list[list[int]] = field(default_factory=list)
    steps: int = 100  # NOSA fine-tuning steps after conversion
    dense_lr: float | None = None  # lr of the dense phase (default optim.lr)
    freeze_base: bool = False  # NOSA phase: train the eviction heads only
    eval_every: int = 50  # held-out eval every N steps and at the last step of each phase; 0: only the last
    eval_examples: int = 32  # held-out rows each eval reads
    save_every: int = 0  # checkpoint every N steps; 0: only at the end of each phase
    keep_checkpoints: int = 2  # newest checkpoints kept under <out_dir>/checkpoints (a phase's last always)
    # false: checkpoints hold the model and the run's state but not DeepSpeed's optimizer state (Adam's
    # moments and fp32 master weights: most of the bytes, and most of the time a save takes); such a
    # checkpoint is served and evaluated as any other, but a run cannot resume inside its phase from it
    save_optimizer: bool = True
    log_every: int = 1  # log the training metrics every N steps (and with every eval)
    stats_every: int = 0  # selection statistics of one row every N steps (0: only with the eval)
    resume: str | None = None  # a checkpoint dir, or "auto" (latest under out_dir)
    deepspeed: str = "configs/deepspeed/zero2.json"  # DeepSpeed config ("auto" values filled in)
    progress: bool = True  # progress bars on rank 0
    nosa: NosaConfig = field(default_factory=NosaConfig)  # the converted model's NOSA attention (its fields)
    model: ModelSection = field(default_factory=ModelSection)  # the model to train
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)  # its tokenizer
    data: DataSection = field(default_factory=DataSection)  # training and eval rows, and the loss
    optim: OptimSection = field(default_factory=OptimSection)  # AdamW and the learning-rate schedule
    wandb: WandbSection = field(default_factory=WandbSection)  # W&B logging (offline by default)
    distill: DistillSection = field(default_factory=DistillSection)  # the eviction-head fit before the fine-tune

    # ---- derived -------------------------------------------------------------------------------
    @property
    def total_steps(self) -> int:
        return self.dense_steps + self.steps

    @property
    def fit_only(self) -> bool:
        """No NOSA fine-tune, only the eviction-head fit (steps: 0, distill.rows > 0): the run converts,
        fits and writes ``fitted``, with ``nosa`` linked to it."""
        return self.steps == 0 and self.distill.rows > 0

    def stage_at(self, step: int) -> tuple[int, int]:
        """(seq_len, micro_batch) of optimizer step ``step`` (0-based; see ``curriculum``)."""
        end = 0
        for steps, length in self.curriculum:
            end += steps
            if step < end:
                return length, self.micro_batch * self.seq_len // length
        return self.seq_len, self.micro_batch

    @property
    def seq_lens(self) -> list[int]:
        """Every row length the run trains at (curriculum stages and seq_len), ascending."""
        return sorted({length for _, length in self.curriculum} | {self.seq_len})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        """Raise ValueError for values that cannot work. Touches nothing on disk."""
        for name in ("seq_len", "micro_batch", "grad_accum", "eval_examples", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("dense_steps", "steps", "eval_every", "save_every", "stats_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.total_steps < 1 and not self.fit_only:
            raise ValueError("dense_steps + steps must be >= 1 (or steps: 0 with distill.rows > 0: fit the "
                             "eviction heads only)")
        cfg = self.nosa  # checked by NosaConfig when built
        if self.seq_len % cfg.block_size:
            raise ValueError(f"seq_len={self.seq_len} must be a multiple of nosa.block_size={cfg.block_size}")
        self._validate_curriculum(cfg.block_size)
        if self.model.path is None and not self.model.build:
            raise ValueError("model: set model.path (a local checkpoint) or model.build (a config)")
        if self.model.path is not None:
            check_model_path(self.model.path)
        if self.model.build:
            kind = self.model.build.get("model_type", "llama")
            if kind not in SUPPORTED_MODEL_TYPES:
                raise ValueError(
                    f"model.build.model_type={kind!r} is not supported; use one of {SUPPORTED_MODEL_TYPES}"
                )
        if self.tokenizer.path is not None and not os.path.isdir(self.tokenizer.path):
            raise ValueError(f"tokenizer.path={self.tokenizer.path!r} is not a directory")
        if self.data.synthetic is None and self.data.ruler is None and not self.data.train_files:
            raise ValueError("data: set data.synthetic, data.ruler or data.train_files")
        if self.data.synthetic is not None and self.data.ruler is not None:
            raise ValueError("data: set data.synthetic or data.ruler, not both")
        if self.data.ruler is not None:
            self._validate_ruler(self.data.ruler)
        for path in self.data.train_files + self.data.eval_files:
            if not os.path.isfile(path):
                raise ValueError(f"data file not found: {path!r}")
            if not path.endswith((".jsonl", ".json", ".parquet", ".txt", ".text")):
                raise ValueError(f"data file {path!r}: expected .jsonl, .json, .parquet or .txt")
        if self.data.synthetic is not None:
            bad = sorted(set(self.data.synthetic.tasks) - set(TASKS))
            if bad or not self.data.synthetic.tasks:
                raise ValueError(f"data.synthetic.tasks: unknown {bad}; known tasks are {list(TASKS)}")
            depth = self.data.synthetic.depth
            numbers = len(depth) == 2 and all(isinstance(x, (int, float)) for x in depth)
            if not numbers or not 0 <= depth[0] <= depth[1] <= 1:
                raise ValueError(f"data.synthetic.depth={depth!r}: expected [lo, hi] with 0 <= lo <= hi <= 1")
        fit = self.distill
        if fit.rows < 0 or fit.steps < 1 or not fit.scale > 0:
            raise ValueError(
                f"distill.rows={fit.rows}, distill.steps={fit.steps}, distill.scale={fit.scale}: expected "
                "rows >= 0, steps >= 1 and a positive scale"
            )
        if fit.rank_weight < 0 or not fit.rank_tau > 0:
            raise ValueError(f"distill.rank_weight={fit.rank_weight}, distill.rank_tau={fit.rank_tau}: "
                             "expected a weight >= 0 and a positive temperature")
        if not self.data.answer_weight > 0:
            raise ValueError(f"data.answer_weight={self.data.answer_weight}: expected a positive number")
        if not self.data.kl_weight >= 0:
            raise ValueError(f"data.kl_weight={self.data.kl_weight}: expected 0 (off) or a positive weight")
        if self.data.kl_weight and not self.model.path:
            raise ValueError("data.kl_weight needs model.path: the teacher is the pretrained model the run starts from")
        if not self.data.select_weight >= 0 or self.data.select_rows < 1:
            raise ValueError(f"data.select_weight={self.data.select_weight}, data.select_rows={self.data.select_rows}: "
                             "expected a weight >= 0 (0: off) and at least 1 row")
        if self.data.loss_on not in ("all", "targets"):
            raise ValueError(f"data.loss_on={self.data.loss_on!r}: use all or targets")
        if self.wandb.mode not in (None, "offline", "online", "disabled"):
            raise ValueError(f"wandb.mode={self.wandb.mode!r}: use offline, online or disabled")
        if not os.path.isfile(self.deepspeed):
            raise ValueError(f"deepspeed config not found: {self.deepspeed!r}")
        if self.resume not in (None, "auto") and not os.path.isdir(self.resume):
            raise ValueError(f"resume={self.resume!r} is not a checkpoint directory")

    def _validate_ruler(self, sec: RulerSection) -> None:
        bad = sorted(set(sec.tasks) - set(RULER_TASKS))
        if bad or not sec.tasks:
            raise ValueError(f"data.ruler.tasks: unknown {bad}; known tasks are {list(RULER_TASKS)}")
        if sec.train_examples < 1 or sec.heldout_examples < 0:
            raise ValueError(f"data.ruler: train_examples={sec.train_examples}, heldout_examples="
                             f"{sec.heldout_examples}; expected >= 1 and >= 0")
        if sec.style not in RULER_STYLES:
            raise ValueError(f"data.ruler.style={sec.style!r}: expected one of {list(RULER_STYLES)}")
        if sec.prose_rows < 0:
            raise ValueError(f"data.ruler.prose_rows={sec.prose_rows}: expected >= 0")
        if self.model.path is None and self.tokenizer.path is None:
            raise ValueError("data.ruler: its rows are chat turns of the model's tokenizer; set model.path")
        if self.curriculum:
            raise ValueError("data.ruler: its examples are written at seq_len; a curriculum would cut them")

    def _validate_curriculum(self, block_size: int) -> None:
        for stage in self.curriculum:
            ok = isinstance(stage, list) and len(stage) == 2 and all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in stage
            )
            if not ok:
                raise ValueError(f"curriculum: expected [[steps, seq_len], ...] of positive ints, got stage {stage!r}")
            length = stage[1]
            if length > self.seq_len or self.seq_len % length or length % block_size:
                raise ValueError(
                    f"curriculum stage {stage}: seq_len {length} must divide seq_len={self.seq_len} "
                    f"and be a multiple of nosa.block_size={block_size}"
                )
        staged = sum(steps for steps, _ in self.curriculum)
        if staged > self.dense_steps:
            raise ValueError(
                f"curriculum: its {staged} steps exceed dense_steps={self.dense_steps} (it is part of the dense phase)"
            )


def check_model_path(path: str) -> str:
    """The model_type of a local checkpoint; ValueError unless it is a supported causal LM (dense, or
    NOSA: model_type nosa_llama and the like, or a legacy NOSA checkpoint)."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"model.path={path!r} is not a Hugging Face checkpoint (no config.json)")
    with open(config_file) as f:
        data = json.load(f)
    kind = data.get("model_type")
    archs = data.get("architectures") or []
    supported = kind in SUPPORTED_MODEL_TYPES or kind in BY_NAME
    if not supported or (archs and not any(a.endswith("ForCausalLM") for a in archs)):
        raise ValueError(
            f"model.path={path!r} holds model_type={kind!r} architectures={archs}; nosa.train needs a "
            f"causal LM of type {list(SUPPORTED_MODEL_TYPES)} or {list(BY_NAME)} (*ForCausalLM)"
        )
    return kind


# ---- loading -----------------------------------------------------------------------------------
def load_config(path: str | None, overrides: list[str] = (), validate: bool = True) -> TrainConfig:
    """Read YAML (or nothing), apply ``a.b=value`` overrides (values parsed as YAML), validate (unless a
    reader of a few fields, such as the training benchmark's random-weight shapes, says not to)."""
    raw: dict[str, Any] = {}
    if path is not None:
        if not os.path.isfile(path):
            raise ValueError(f"config file not found: {path!r}")
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a mapping at the top level")
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r}: expected key=value")
        key, value = item.split("=", 1)
        _set_dotted(raw, key.strip(), yaml.safe_load(value))
    cfg = _build(TrainConfig, raw, "")
    if validate:
        cfg.validate()
    return cfg


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    for part in parts[:-1]:
        node = tree.get(part)
        if node is None:
            node = tree[part] = {}
        if not isinstance(node, dict):
            raise ValueError(f"override {key!r}: {part!r} is not a section")
        tree = node
    tree[parts[-1]] = value


def _build(cls, raw: Any, where: str):
    if not isinstance(raw, dict):
        raise ValueError(f"config section {where or '<top>'!r} must be a mapping, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    renamed = sorted(set(raw) & set(_RENAMED)) if cls is TrainConfig else []
    if renamed:
        raise ValueError("renamed config key(s): " + ", ".join(f"{old} is now {_RENAMED[old]}" for old in renamed))
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        prefix = f"{where}." if where else ""
        raise ValueError(
            f"unknown config key(s) {[prefix + k for k in unknown]}; known keys in "
            f"{where or 'the top level'} are {sorted(fields)}"
        )
    kwargs = {}
    for name, value in raw.items():
        sub = _SECTIONS.get((cls, name))
        if (cls, name) == (TrainConfig, "nosa"):
            value = NosaConfig.from_dict(value)  # ValueError naming the field
        elif sub is not None and value is not None:
            value = _build(sub, value, f"{where}.{name}" if where else name)
        kwargs[name] = _check_type(cls, fields[name], value, where)
    return cls(**kwargs)


def _check_type(cls, f, value, where):
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    name = f"{where}.{f.name}" if where else f.name
    if value is None or default is None or dataclasses.is_dataclass(value):
        return value
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, float):
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, str):
        ok = isinstance(value, str)
    elif isinstance(default, list):
        ok = isinstance(value, list)
    elif isinstance(default, dict):
        ok = isinstance(value, dict)
    else:
        ok = True
    if not ok:
        raise ValueError(f"config key {name}: expected {type(default).__name__}, got {value!r}")
    return value


_SECTIONS = {
    (TrainConfig, "model"): ModelSection,
    (TrainConfig, "tokenizer"): TokenizerSection,
    (TrainConfig, "data"): DataSection,
    (TrainConfig, "optim"): OptimSection,
    (TrainConfig, "wandb"): WandbSection,
    (TrainConfig, "distill"): DistillSection,
    (DataSection, "synthetic"): SyntheticSection,
    (DataSection, "ruler"): RulerSection,
}
# keys of earlier versions -> their names now (an old key fails, naming the new one)
_RENAMED = {
    "distill_rows": "distill.rows",
    "distill_steps": "distill.steps",
    "distill_lr": "distill.lr",
    "distill_scale": "distill.scale",
    "distill_rank": "distill.rank_weight",
    "distill_rank_tau": "distill.rank_tau",
}
