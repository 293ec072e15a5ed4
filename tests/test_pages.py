"""futx.engine.pages: the page pool and the prefix cache, property-style on random operation sequences (CPU,
no torch)."""

import random

import pytest

from futx.engine.pages import PagePool, PrefixCache, page_keys

P = 128


def test_pool_allocates_all_or_nothing_and_refuses_double_free():
    pool = PagePool(4)
    a = pool.allocate(3)
    assert sorted(a) == [0, 1, 2] and pool.free_count == 1
    with pytest.raises(MemoryError, match="4 pages asked, 1 of 4 free"):
        pool.allocate(4)
    assert pool.free_count == 1
    pool.share(a[0])
    pool.free([a[0]])
    assert pool.refs[a[0]] == 1 and pool.free_count == 1
    pool.free(a)
    assert pool.free_count == 4
    with pytest.raises(ValueError, match="double free"):
        pool.free([a[1]])
    with pytest.raises(ValueError, match="only a held page"):
        pool.share(a[1])
    with pytest.raises(ValueError, match="out of range"):
        pool.free([4])
    pool.check()


def test_keys_name_the_whole_prefix():
    a = list(range(3 * P))
    b = list(a)
    b[5] = 999                                       # differs in page 0 only
    ka, kb = page_keys(a, P, 3), page_keys(b, P, 3)
    assert len(set(ka)) == 3 and all(x != y for x, y in zip(ka, kb))   # every later key differs too
    assert page_keys(a + [7, 8], P, 3) == ka
    with pytest.raises(ValueError, match="full pages"):
        page_keys(a[:-1], P, 3)


def test_prefix_cache_shares_and_evicts_idle_pages_only():
    pool = PagePool(6)
    cache = PrefixCache(pool, P)
    prompt = list(range(2 * P + 10))
    mine = pool.allocate(3)
    assert cache.publish(prompt, mine, 2) == 2 and len(cache) == 2
    pool.free(mine)                                  # the request finished: pages 0, 1 stay cached, page 2 free
    assert pool.free_count == 4 and cache.idle_pages() == 2
    got = cache.attach(prompt + [1, 2], max_pages=5)
    assert got == mine[:2] and all(pool.refs[p] == 2 for p in got)
    assert cache.attach(prompt, max_pages=1) == mine[:1]
    pool.free(mine[:1])
    assert cache.evict(5) == 0                       # both held by the attached request
    pool.free(got)
    assert cache.evict(1) == 1 and len(cache) == 1   # the deeper page first: the root stays reachable
    assert cache.attach(prompt, 2) == mine[:1]
    pool.free(mine[:1])
    assert cache.clear() == 1 and pool.free_count == 6
    pool.check()


@pytest.mark.parametrize("seed", range(6))
def test_random_join_leave_preempt_sequences_conserve_pages(seed):
    """Requests join (attaching cached prefixes), grow page by page, leave (publishing their prompt pages) or are
    preempted (giving everything back), with eviction when the pool runs dry: after every operation each page is
    free xor held, refcounts equal the holders counted independently, and eviction never frees a held page."""
    rng = random.Random(seed)
    pages = rng.randint(4, 24)
    pool = PagePool(pages)
    cache = PrefixCache(pool, P)
    prompts = [[rng.randrange(3) for _ in range(P)] * rng.randint(1, 4) for _ in range(5)]  # shared prefixes
    live: dict[int, tuple[list, list]] = {}   # id -> (prompt, pages)
    ids = iter(range(10 ** 6))

    def holders() -> list[int]:
        refs = [0] * pages
        for _, held in live.values():
            for p in held:
                refs[p] += 1
        for p in cache._pages.values():
            refs[p] += 1
        return refs

    def take(n: int) -> list:
        if pool.free_count < n:
            before = {p for _, held in live.values() for p in held}
            cache.evict(n - pool.free_count)
            assert all(pool.refs[p] > 0 for p in before)   # eviction never freed a page a request holds
        return pool.allocate(n) if pool.free_count >= n else None

    for _ in range(400):
        op = rng.random()
        if op < 0.35:                                            # join
            prompt = rng.choice(prompts)[:rng.randint(1, 4 * P)]
            held = cache.attach(prompt, rng.randint(0, 4))
            more = take(rng.randint(0, 2))
            if more is None:
                pool.free(held)
            else:
                live[next(ids)] = (prompt, held + more)
        elif op < 0.6 and live:                                  # grow by a page
            rid = rng.choice(list(live))
            more = take(1)
            if more is not None:
                live[rid][1].extend(more)
        elif op < 0.85 and live:                                 # leave, publishing its full prompt pages
            prompt, held = live.pop(rng.choice(list(live)))
            cache.publish(prompt, held, len(prompt) // P)
            pool.free(held)
        elif live:                                               # preempted: everything back
            _, held = live.pop(rng.choice(list(live)))
            pool.free(held)
        pool.check()
        assert holders() == pool.refs
        assert pool.free_count + sum(1 for r in pool.refs if r) == pages
    for _, held in live.values():
        pool.free(held)
    cache.clear()
    assert pool.free_count == pages and len(cache) == 0
