"""OffloadEngine: the offloading parts of one nosa backend, and what they do at each step.

``start`` (when $NOSA_OFFLOAD=1) checks the settings and the host pool's hooks, then builds the
device block cache, the recall scheduler, the admission controller and the step counters. Per
forward pass the backend calls ``begin(metadata)``, then per layer ``view`` (host-side reads),
``resolve_layer`` (a decode layer, fixed shapes: the engine is a LayerResolver of
nosa.serve.decode_runner) and ``prefetch`` (the next layer's blocks, in steps that are not
captured), and ``end_step()`` after a decode step (a captured step's is closed by the next
``begin``). The request registry calls ``release(row)`` and ``counters()``.
"""

from __future__ import annotations

import logging

from nosa.decode import WantedBlocks
from nosa.kv import DeviceRows
from nosa.kvquant import QuantizedItems, roundtrip
from nosa.serve.metadata import ForwardMetadata, StepInputs, captured
from nosa.serve.offload import admission
from nosa.serve.offload.block_cache import DeviceBlockCache
from nosa.serve.offload.kv import OffloadKV, predicted_blocks
from nosa.serve.offload.recall import RecallScheduler
from nosa.serve.offload.resolve import NewTokens, PageTable, host_pages
from nosa.serve.offload.settings import OffloadSettings
from nosa.serve.offload.stats import StepRecord, StepStats

logger = logging.getLogger(__name__)


class OffloadEngine:
    """The offloading parts of one backend; a LayerResolver (nosa.serve.decode_runner) that does not
    read SGLang's pool in place (``in_place`` False: the KV is in the host pool)."""

    in_place = False

    def __init__(self, model_runner, cfg, cache: DeviceBlockCache, scheduler=None, admission=None):
        self.cfg, self.cache, self.scheduler, self.admission = cfg, cache, scheduler, admission
        self.pool = model_runner.token_to_kv_pool  # the host pool (nosa.serve.offload.host_pool.HostKVPool)
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.device = model_runner.device
        self.num_layers = len(cache.blocks)
        self.stats = StepStats(cache, scheduler)
        self._blocks: dict[int, int] = {}  # group -> context blocks of the running decode step (admission)
        self.peak_slots = 0  # the most resident block items (layers x KV heads x slots) after a decode step
        self._step_open = False  # a decode step began and has no record yet
        self.metrics = None  # nosa.serve.metrics.NosaMetrics: per-request hit rates when a request leaves
        self._life: dict[int, list[int]] = {}  # group -> [blocks selected, recalled on demand] (with metrics)

    @classmethod
    def start(cls, model_runner, cfg, num_layers: int, num_kv_heads: int, head_dim: int, model_dir: str,
              shard) -> "OffloadEngine":
        """Validate the settings, check that the host pool hooks took effect, build the parts.
        ``model_dir``: the checkpoint's folder (its key factors); ``shard``: this rank's KV heads
        (nosa.serve.parallel.KVHeadShard)."""
        from nosa.serve.offload import host_pool  # optional: sglang (the decode harness builds engines without it)

        settings = OffloadSettings.from_env()
        settings.validate(cfg, model_runner.server_args.page_size)
        for role in ("prefill_attention_backend", "decode_attention_backend"):
            chosen = getattr(model_runner.server_args, role, None)
            if chosen not in (None, "nosa"):
                flag = "--" + role.replace("_", "-")
                raise ValueError(f"nosa backend: offloading needs nosa for prefill and decode ({flag} {chosen}): "
                                 "other backends cannot read the host pool")
        host_pool.verify(model_runner, settings, cfg)
        pool = model_runner.token_to_kv_pool
        layers = sorted(pool.nosa_index, key=pool.nosa_index.get)  # the NOSA layers this pool holds, in its order
        factors = host_pool.install_key_factors(pool, model_dir, layers, shard)
        logger.info("nosa offloading: host KV %s, %s", getattr(pool, "kv_dtype", None), factors)
        scheduler = None
        if settings.schedule:
            scheduler = RecallScheduler(num_layers, settings.chunk_items)
        cache = DeviceBlockCache(
            num_layers, settings.max_requests(cfg), num_kv_heads, settings.slots_per_head(cfg), cfg.block_size,
            head_dim, pool.v_head_dim, pool.dtype, model_runner.device, scheduler=scheduler,
            home_slots=settings.home_slots(cfg),
        )
        if getattr(pool, "quantized", False):  # what a recall moves: the host's bytes (data, scales, cis)
            cache.item_bytes = cfg.block_size * pool.bytes_per_token_head
        admission = _start_admission(settings, cfg, cache, pool, num_layers, num_kv_heads) if settings.admission \
            else None
        return cls(model_runner, cfg, cache, scheduler, admission)

    # ---- per forward pass ----------------------------------------------------------------------
    def groups_of(self, rows: list[int]):
        """[R] the device group of each request row (nosa.serve.metadata.ForwardMetadata.groups)."""
        return self.cache.groups_of(rows)

    def begin(self, metadata: ForwardMetadata) -> list[bool] | None:
        """A forward pass starts (host side): the decode step before it gets its record if it has
        none yet (a captured step); a starting request takes back its slot columns lent to others;
        a decode step drops stale blocks and starts its counters. Returns, for a decode step,
        whether each request's group is warm (its previous step was a decode step)."""
        if self._step_open:
            self.end_step()
        real = [i for i, row in enumerate(metadata.rows) if row]  # row 0: a captured batch's padding
        for i in real:
            self.cache.activate(metadata.rows[i])
        if not metadata.decode:
            return None
        self.stats.begin(len(real))
        self.cache.clear_group_bytes()
        groups = [g for i, g in enumerate(metadata.groups.tolist()) if metadata.rows[i]]
        lengths = [metadata.lengths[i] for i in real]
        self._blocks = {g: -(-n // self.cache.block) for g, n in zip(groups, lengths)}
        self._step_open = True
        warm = iter(self.cache.begin_decode(groups, lengths))
        return [bool(row) and next(warm) for row in metadata.rows]

    def view(self, layer: int, metadata: ForwardMetadata, new_tokens: NewTokens | None = None) -> OffloadKV:
        """The KV view of ``layer`` for the requests of ``metadata`` (decode: with their new tokens)."""
        return OffloadKV(self.pool, self.cache, self.req_to_token, layer, metadata, self.device, new_tokens)

    def resolve_layer(self, layer: int, wanted: WantedBlocks, inputs: StepInputs, new_tokens: NewTokens) -> DeviceRows:
        """A decode layer's wanted blocks (nosa.decode.WantedBlocks) for the step's requests
        (nosa.serve.metadata.StepInputs), resident in the device block cache: its DeviceRows. Fixed
        shapes; in a step that runs eagerly with the recall scheduler, the layer's prefetch is
        claimed first."""
        pages = PageTable(self.req_to_token, inputs.rows)  # looked up where needed (the CPU kernel: itself)
        prefetched = None
        if self.scheduler is not None and not captured():
            prefetched = self.cache.claim_prefetch(layer, inputs.groups)
        host = self.pool.items(layer)
        if isinstance(host[0], QuantizedItems):
            # the new token goes into its device slot as a recall would bring it back (quantized, then
            # dequantized): attention reads every token the same way, however long its block stays resident
            new_tokens = new_tokens._replace(k=roundtrip(new_tokens.k, host[0].data.dtype, check_finite=False,
                                                         factor=host[0].factor),
                                             v=roundtrip(new_tokens.v, host[1].data.dtype, check_finite=False))
        return self.cache.resolve_layer(layer, inputs.groups, wanted.blocks, inputs.lengths, pages, host, new_tokens,
                                        inputs.warm, inputs.real, prefetched)

    def prefetch(self, layer: int, metadata: ForwardMetadata, states) -> None:
        """Start moving ``layer``'s predicted blocks for this decode step (the layer before it is
        about to attend). ``states``: the request registry (nosa.serve.registry.RequestRegistry)."""
        if layer >= self.num_layers or not all(metadata.rows):  # padding rows (a graph runner's capture): none
            return
        if not self.cache.may_prefetch(layer, metadata.groups, metadata.lengths):
            return
        layer_states = [states.get(row, layer) for row in metadata.rows]
        if all(s is None for s in layer_states):
            return
        predicted = predicted_blocks(layer_states, metadata.lengths, self.cfg)
        pages = host_pages(self.req_to_token, metadata.table_rows, predicted, self.cache.block)
        self.cache.prefetch(layer, metadata.groups, predicted, metadata.lengths, pages, self.pool.items(layer))

    def end_step(self) -> StepRecord:
        """After a decode step's last layer: its record; admission (if on) learns from it and lends
        the spare slot columns for the next step."""
        self._step_open = False
        record = self.stats.end()
        if self.metrics is not None:  # each request's selected and recalled blocks, for its hit rate
            misses = self.cache.group_misses.tolist()
            per_block = self.num_layers * self.cache.hkv
            for g, blocks in self._blocks.items():
                life = self._life.setdefault(g, [0, 0])
                life[0] += per_block * min(self.cfg.topk_blocks, blocks)
                life[1] += misses[g]
        self.peak_slots = max(self.peak_slots, record.resident_slots)
        if self.admission is not None:
            self._feed_admission(record)
        self.stats.log(record)
        return record

    def _feed_admission(self, record: StepRecord) -> None:
        control, cache, layers = self.admission, self.cache, record.layers
        recalled_bytes = sum(layers["recalled_bytes"]) + sum(layers["prefetched"]) * cache.item_bytes
        control.observe_transfer(recalled_bytes, sum(layers["recall_seconds"]))
        control.observe_step(max(record.wall_seconds - record.stall_seconds, 1e-9), cache.step_group_bytes(),
                             self._blocks)
        spare = cache.free_columns() + len(cache.lent)
        control.extra = cache.set_extra(control.grants(spare))  # what was granted
        record.admission = control.snapshot()

    # ---- called by the request registry --------------------------------------------------------
    def release(self, row: int) -> None:
        """The request of ``row`` left: its device slots are free and admission forgets it."""
        self.cache.release(row)
        life = self._life.pop(row - 1, None)  # request row r owns group r - 1
        if self.metrics is not None and life:
            self.metrics.request_done(life[0], life[0] - life[1])
        if self.admission is not None:
            self.admission.forget(row - 1)  # request row r owns group r - 1 (nosa.serve.offload.block_cache)

    def counters(self, timeline: bool = True) -> dict:
        """The engine's counters for the stats file: slots in use, the cache's, the scheduler's and
        admission's counters, and the step timeline (unless ``timeline`` is False: the stats file
        writes it from ``stats.snapshot_json()``)."""
        out = {"device_slots_in_use": self.cache.resident_slots(), "peak_device_slots": self.peak_slots,
               "offload": {k: list(v) for k, v in self.cache.stats.items()}}
        if timeline:
            out["timeline"] = self.stats.snapshot()
        if self.scheduler is not None:
            out["scheduler"] = {k: list(v) for k, v in self.scheduler.stats.items()}
        if self.admission is not None:
            out["admission"] = self.admission.snapshot()
        return out


def _start_admission(settings, cfg, cache, pool, num_layers: int, num_kv_heads: int):
    """The admission controller, seeded by a start-up probe of the link (nosa.serve.offload.admission)."""
    admission.verify_hooks()
    control = admission.Admission(
        admission.AdmissionPolicy(max_extra=settings.extra_slots), cache.item_bytes, cfg.topk_blocks,
        bound_items=(cfg.query_blocks + 1) * num_kv_heads * num_layers)
    bandwidth, nbytes, seconds = admission.probe_bandwidth([cache.k[0], cache.v[0], cache.cis[0]], pool.items(0))
    control.bw = bandwidth
    logger.info("nosa admission: link probe %d bytes in %.6f s = %.2f GB/s", nbytes, seconds, bandwidth / 1e9)
    return control
