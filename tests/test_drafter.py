"""The sibling n-gram drafter and the block manager's draft slots, without torch."""

import subprocess
import sys
from types import SimpleNamespace

import pytest

from rollplex.engine.block_manager import BlockManager
from rollplex.engine.drafter import DrafterConfig, SuffixDrafter
from rollplex.engine.sampling_params import SamplingParams
from rollplex.engine.sequence import Request

PROMPT = [100, 101, 102, 103]


def _drafter(**kw) -> SuffixDrafter:
    d = SuffixDrafter(DrafterConfig(**kw))
    d.open("g", PROMPT)
    return d


def test_drafter_imports_no_torch():
    code = "import sys; import rollplex.engine.drafter; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_sibling_drafts_its_continuation():
    d = _drafter()
    d.extend("g", 0, [1, 2, 3, 4, 5, 6])
    assert d.propose("g", [7, 2, 3], 3) == [4, 5, 6]
    assert d.propose("g", [7, 2, 3], 2) == [4, 5]  # at most k
    assert d.propose("g", [7, 5, 6], 4) == []  # 6 was never followed
    assert d.propose("g", [9], 3) == []  # never seen


def test_a_fresh_sequence_drafts_from_the_shared_prompt_tail():
    d = _drafter()
    d.extend("g", 0, [1, 2, 3])
    assert d.propose("g", [], 3) == [1, 2, 3]  # the prompt's last tokens are the context


def test_the_longest_seen_context_decides():
    d = _drafter()
    d.extend("g", 0, [5, 1, 2, 8, 8, 8])
    d.extend("g", 1, [6, 1, 2, 9])
    d.extend("g", 2, [7, 1, 2, 9])
    assert d.propose("g", [1, 2], 1) == [9]  # after (1, 2): 9 twice, 8 once
    assert d.propose("g", [5, 1, 2], 1) == [8]  # the longer context (5, 1, 2) was followed by 8


def test_min_share_stops_an_uncertain_draft():
    d = _drafter(min_share=0.6)
    d.extend("g", 0, [1, 2, 3])
    d.extend("g", 1, [1, 2, 4])
    d.extend("g", 2, [1, 7, 7])
    # after 1 (with the prompt tail 103 before it): 2 twice of three, then (1, 2) -> 3 / 4 split evenly
    assert d.propose("g", [1], 3) == [2]


def test_incremental_extend_counts_each_ngram_once():
    one, inc = _drafter(max_ngram=3), _drafter(max_ngram=3)
    text = [1, 2, 1, 2, 3, 1, 2, 3, 4]
    one.extend("g", 0, text)
    for i in range(1, len(text) + 1):
        inc.extend("g", 0, text[:i])
        inc.extend("g", 0, text[:i])  # a repeated call adds nothing
    assert inc.groups["g"].table == one.groups["g"].table
    assert one.groups["g"].table[(1, 2)] == {1: 1, 3: 2}


def test_a_sequence_passes_its_whole_token_list_and_prompt_length():
    """extend / propose over tokens[offset:] (no copy of the output) == over the output itself."""
    sliced, offset = _drafter(max_ngram=3), _drafter(max_ngram=3)
    prompt = [100, 101, 102, 103]
    text = [1, 2, 1, 2, 3, 1, 2, 3, 4]
    for i in range(len(text) + 1):
        sliced.extend("g", 0, text[:i])
        offset.extend("g", 0, prompt + text[:i], len(prompt))
        assert offset.groups["g"].table == sliced.groups["g"].table
        for j in range(i + 1):
            assert offset.propose("g", prompt + text[:j], 3, len(prompt)) == sliced.propose("g", text[:j], 3)


def test_prompt_cache_seeds_a_later_group_of_the_same_prompt():
    d = SuffixDrafter(DrafterConfig(cache_prompts=2))
    d.remember(PROMPT, [[1, 2, 3, 4], []])
    d.open("later", PROMPT)
    assert d.propose("later", [], 4) == [1, 2, 3, 4]
    d.open("other", [5, 6, 7])
    assert d.propose("other", [], 4) == []
    # least recently used prompts leave first; a key (images included) may stand for the token ids
    d.remember([1], [[9]])
    d.remember([2], [[9]], prompt_key="two")
    assert list(d.cache) == [(1,), "two"]
    off = SuffixDrafter()
    off.remember(PROMPT, [[1, 2, 3]])
    off.open("g", PROMPT)
    assert off.propose("g", [], 3) == []


def test_groups_close_and_bad_configs_raise():
    d = _drafter()
    with pytest.raises(ValueError, match="already open"):
        d.open("g", PROMPT)
    d.open("h", PROMPT)
    d.retain(["h"])
    assert list(d.groups) == ["h"]
    d.close("h")
    d.close("never")
    for bad in ({"min_ngram": 0}, {"min_ngram": 4, "max_ngram": 3}, {"min_share": 1.0}, {"cache_prompts": -1},
                {"max_ngram": 64}):
        with pytest.raises(ValueError):
            DrafterConfig(**bad)


def test_reserve_and_trim_draft_slots():
    bm = BlockManager(num_blocks=6, block_size=4)
    req = Request("r", SimpleNamespace(input_ids=[0] * 6), SamplingParams(n=1), seeds=[0])
    seq = req.seqs[0]
    bm.allocate(seq, 6)  # 2 blocks
    assert bm.reserve(seq, 6 + 5)  # 11 tokens: 3 blocks
    assert len(seq.block_table) == 3 and bm.num_free == 2
    assert not bm.reserve(seq, 6 + 20)  # needs 4 more: nothing taken
    assert len(seq.block_table) == 3 and bm.num_free == 2
    bm.trim(seq, 8)  # two tokens kept past the 6: 2 blocks
    assert len(seq.block_table) == 2 and bm.num_free == 3
    bm.trim(seq, 8)
    assert len(seq.block_table) == 2
    bm.free(seq)
    assert bm.num_free == 5
