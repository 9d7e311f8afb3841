import pytest

from nosa import NosaConfig


def test_defaults_are_the_released_nosa_values():
    cfg = NosaConfig()
    released = (64, 32, 16, 1, 17, 64, 15)  # thunlp/NOSA: window = current block + 16 before it
    got = (cfg.block_size, cfg.compress_kernel, cfg.compress_stride, cfg.sink_blocks,
           cfg.window_blocks, cfg.topk_blocks, cfg.query_blocks)
    assert got == released
    assert cfg.budget_tokens == 4096 and cfg.max_blocks_entering_per_step == 16
    assert cfg.sink_blocks + cfg.window_blocks + cfg.query_blocks == 33  # the release's query-aware set


@pytest.mark.parametrize(
    "overrides, field, rule",
    [
        (dict(block_size=0), "block_size=0", "positive"),
        (dict(compress_stride=-4), "compress_stride=-4", "positive"),
        (dict(window_blocks=0), "window_blocks=0", "positive"),
        (dict(topk_blocks=0), "topk_blocks=0", "positive"),
        (dict(sink_blocks=-1), "sink_blocks=-1", "non-negative"),
        (dict(dense_len=-1), "dense_len=-1", "non-negative"),
        (dict(compress_kernel=10), "compress_kernel=10", "multiple of compress_stride=4"),
        (dict(block_size=18, compress_kernel=12, compress_stride=12), "block_size=18", "multiple of"),
        (dict(topk_blocks=4), "topk_blocks=4", "= 5"),
        (dict(window_blocks=1), "compress_kernel - compress_stride = 4", "window_blocks - 1"),
        (dict(block_size=16.0), "block_size must be an int", "float"),
        (dict(query_blocks=True), "query_blocks must be an int", "bool"),
    ],
)
def test_invalid_configs_name_field_value_and_rule(overrides, field, rule):
    with pytest.raises(ValueError) as err:
        NosaConfig.tiny(**overrides)
    assert field in str(err.value) and rule in str(err.value)


def test_serialisation_round_trip_and_unknown_fields():
    cfg = NosaConfig.tiny(dense_len=48)
    assert NosaConfig.from_json(cfg.to_json()) == cfg
    assert NosaConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['blocksize'\]"):
        NosaConfig.from_dict({"blocksize": 64})
    with pytest.raises(ValueError, match="must be a mapping"):
        NosaConfig.from_dict([64])


def test_derived_sizes():
    cfg = NosaConfig()
    assert [cfg.num_blocks(n) for n in (1, 64, 65)] == [1, 1, 2]
    assert [cfg.num_compressed(n) for n in (31, 32, 47, 48)] == [0, 1, 1, 2]
