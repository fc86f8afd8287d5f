"""The shared header is the single source of the tag/metadata/mark constants and matches ARCHITECTURE §4-5."""

from hypafilter import shared


def test_metadata_layout_matches_architecture():
    m = shared.pack_meta(index=0x123456, action=2, reason=1, generation=0xBEEF)
    assert m == (0x4846 << 48) | (0xBEEF << 32) | (1 << 28) | (2 << 24) | 0x123456
    assert shared.unpack_meta(m) == {"index": 0x123456, "action": 2, "reason": 1, "generation": 0xBEEF, "magic": 0x4846}


def test_tag_and_mark_constants():
    assert shared.HF_TAG_ETHERTYPE == 0x88B5
    assert shared.HF_MARK_K_SHIFT == 4
    assert shared.HF_K_NONE == 0
    assert shared.HF_MAP_INTERVALS == "hf_intervals"
