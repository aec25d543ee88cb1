import random

import pytest
import torch
from kernel_testing import ALL_BACKENDS, DEVICE

from pagoda.kernels.integrity import TAG_MAX, check_page_tags, find_mismatches, next_tag, next_tags


def test_next_tag_wraps_and_skips_zero():
    assert next_tag(0) == 1
    assert next_tag(1) == 2
    assert next_tag(TAG_MAX - 1) == TAG_MAX
    assert next_tag(TAG_MAX) == 1
    with pytest.raises(ValueError):
        next_tag(-1)
    tags = torch.tensor([0, 5, TAG_MAX], dtype=torch.int32)
    assert next_tags(tags).tolist() == [1, 6, 1]


def test_tag_returns_only_after_full_cycle():
    # From tag t, the sequence of tags revisits t after exactly 2**31 - 1 bumps (never before):
    # it is a cycle over 1..TAG_MAX, so it suffices to check the wrap point and its neighbours.
    t = TAG_MAX - 2
    seen = [t]
    for _ in range(5):
        seen.append(next_tag(seen[-1]))
    assert seen == [TAG_MAX - 2, TAG_MAX - 1, TAG_MAX, 1, 2, 3]


def random_batch(rng: random.Random, batch: int, max_pages: int, total: int):
    tag_table = torch.tensor([rng.randint(1, TAG_MAX) for _ in range(total)], dtype=torch.int32)
    pages = torch.zeros(batch, max_pages, dtype=torch.int32)
    tags = torch.zeros(batch, max_pages, dtype=torch.int32)
    num = torch.tensor([rng.randint(0, max_pages) for _ in range(batch)], dtype=torch.int32)
    for b in range(batch):
        for i in range(max_pages):
            if i < num[b]:
                p = rng.randrange(total)
                pages[b, i], tags[b, i] = p, tag_table[p]
            else:  # padding: garbage that must be ignored
                pages[b, i], tags[b, i] = rng.choice([0, -5, total + 3]), rng.randint(0, 9)
    return pages, tags, num, tag_table


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("batch,seed", [(1, 0), (3, 1), (7, 2), (33, 3)])
def test_injected_mismatches_all_flagged_no_false_positives(backend, batch, seed):
    rng = random.Random(seed)
    total = 50
    pages, tags, num, table = random_batch(rng, batch, 6, total)
    clean = check_page_tags(
        pages.to(DEVICE), tags.to(DEVICE), num.to(DEVICE), table.to(DEVICE), backend=backend
    )
    assert clean.dtype == torch.bool and clean.shape == (batch,)
    assert not clean.any(), "false positive on a consistent batch"
    injected = set()
    for b in range(batch):
        if num[b] == 0 or rng.random() < 0.4:
            continue
        i = rng.randrange(int(num[b]))
        kind = rng.choice(["stale", "oob_high", "oob_neg", "wrong_page"])
        if kind == "stale":
            table[pages[b, i]] = next_tag(int(table[pages[b, i]]))  # page reallocated
            injected |= {
                bb for bb in range(batch) for j in range(int(num[bb])) if pages[bb, j] == pages[b, i]
            }
        elif kind == "oob_high":
            pages[b, i] = total + rng.randrange(100)
        elif kind == "oob_neg":
            pages[b, i] = -1 - rng.randrange(100)
        else:
            other = (int(pages[b, i]) + 1) % total
            if table[other] == tags[b, i]:
                continue
            pages[b, i] = other
        injected.add(b)
    got = check_page_tags(
        pages.to(DEVICE), tags.to(DEVICE), num.to(DEVICE), table.to(DEVICE), backend=backend
    )
    ref = check_page_tags(pages, tags, num, table, backend="reference")
    assert set(torch.nonzero(got.cpu()).flatten().tolist()) == injected
    assert torch.equal(got.cpu(), ref)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_corrupt_page_count_fails_closed(backend):
    pages = torch.zeros(3, 2, dtype=torch.int32)
    tags = torch.ones(3, 2, dtype=torch.int32)
    table = torch.ones(4, dtype=torch.int32)
    num = torch.tensor([2, 3, -1], dtype=torch.int32)
    got = check_page_tags(
        pages.to(DEVICE), tags.to(DEVICE), num.to(DEVICE), table.to(DEVICE), backend=backend
    )
    assert got.cpu().tolist() == [False, True, True]


def test_find_mismatches_details():
    table = torch.tensor([0, 7, 9, 4], dtype=torch.int32)
    pages = torch.tensor([[1, 2, 0], [3, 9, 0]], dtype=torch.int32)
    tags = torch.tensor([[7, 8, 5], [4, 1, 0]], dtype=torch.int32)
    num = torch.tensor([2, 2], dtype=torch.int32)
    assert find_mismatches(pages, tags, num, table) == [(0, 1, 2, 8, 9), (1, 1, 9, 1, None)]


def test_shape_validation():
    with pytest.raises(ValueError):
        check_page_tags(
            torch.zeros(2, 3, dtype=torch.int32),
            torch.zeros(2, 2, dtype=torch.int32),
            torch.zeros(2, dtype=torch.int32),
            torch.zeros(4, dtype=torch.int32),
        )
