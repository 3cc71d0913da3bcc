"""The lab's prefix cache: chained block hashes, vLLM-style hit counting, LRU eviction."""

from kvwatch.lab.prefix_cache import PrefixCache, block_hashes


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_only_full_blocks_are_hashed():
    assert len(block_hashes(tokens(47), 16)) == 2
    assert len(block_hashes(tokens(48), 16)) == 3
    assert block_hashes(tokens(15), 16) == []


def test_block_hash_chains_the_whole_prefix():
    a = tokens(32)
    b = [999] + tokens(31, 1)  # same second block, different first block
    assert block_hashes(a, 16)[1] != block_hashes(b, 16)[1]
    assert block_hashes(a, 16) == block_hashes(list(a), 16)


def test_cold_prompt_has_no_hits_and_repeat_hits_whole_blocks():
    cache = PrefixCache(capacity_blocks=100)
    prompt = tokens(100)
    assert cache.match(prompt) == 0
    cache.insert(prompt)
    # 100 tokens: 6 full blocks cached; the last token is never a hit, 99 // 16 = 6 blocks.
    assert cache.match(prompt) == 96


def test_last_prompt_token_is_never_a_hit():
    cache = PrefixCache(capacity_blocks=100)
    prompt = tokens(64)
    cache.insert(prompt)
    # Exactly 4 full blocks cached, but hitting all 64 would leave nothing to compute.
    assert cache.match(prompt) == 48


def test_a_longer_conversation_reuses_its_cached_prefix():
    cache = PrefixCache(capacity_blocks=100)
    round1 = tokens(40)
    cache.insert(round1 + tokens(10, 500))  # prompt + answer
    round2 = round1 + tokens(10, 500) + tokens(30, 900)
    assert cache.match(round2) == 48  # 50 tokens of history -> 3 full blocks


def test_a_change_at_the_front_invalidates_everything_after_it():
    cache = PrefixCache(capacity_blocks=100)
    cache.insert(tokens(200))
    assert cache.match([12345] + tokens(199, 1)) == 0


def test_lru_evicts_the_least_recently_used_blocks_first():
    cache = PrefixCache(capacity_blocks=4)
    first, second = tokens(32), tokens(32, 1000)
    cache.insert(first)
    cache.insert(second)
    assert len(cache) == 4
    assert cache.match(first + [1]) == 32  # touching `first` makes `second` the oldest
    cache.insert(tokens(32, 5000))
    assert len(cache) == 4
    assert cache.match(first + [1]) == 32
    assert cache.match(second + [1]) == 0


def test_eviction_takes_a_sequence_tail_before_its_head():
    cache = PrefixCache(capacity_blocks=3)
    cache.insert(tokens(48))  # blocks A, B, C
    cache.insert(tokens(16, 7000))  # one new block: evicts C, the tail, not A
    assert cache.match(tokens(48) + [1]) == 32


def test_usage_and_clear():
    cache = PrefixCache(capacity_blocks=10)
    cache.insert(tokens(80))
    assert cache.usage == 0.5
    cache.clear()
    assert cache.usage == 0 and cache.match(tokens(80)) == 0


def test_held_counts_what_match_would_serve_without_touching_the_lru_order():
    cache = PrefixCache(capacity_blocks=2, block_size=16)
    old, new = tokens(33), tokens(33, 1000)
    cache.insert(old[:16])
    cache.insert(new[:16])
    assert cache.held(new) == 16 and cache.held(old) == 16 and cache.held(tokens(33, 5000)) == 0
    cache.insert(tokens(16, 9000))  # evicts the least recently used: `old`, as `held` did not touch it
    assert cache.held(old) == 0 and cache.held(new) == 16
