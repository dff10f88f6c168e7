from verispec.drafters.prompt_lookup import find_continuation, find_continuations


def test_docstring_example():
    assert find_continuation([1, 2, 3, 4, 2, 3], max_ngram=2, k=2) == [4, 2]


def test_no_match():
    assert find_continuation([1, 2, 3, 4], max_ngram=3, k=4) == []


def test_longest_ngram_preferred_over_recent_shorter():
    # suffix [5, 6]: bigram match at 0 -> 7; unigram 6 matches more recently at 4 -> 9
    tokens = [5, 6, 7, 0, 6, 9, 5, 6]
    assert find_continuation(tokens, max_ngram=2, k=1) == [7]
    assert find_continuation(tokens, max_ngram=1, k=1) == [9]


def test_most_recent_match_and_cap():
    tokens = [1, 2, 8, 8, 1, 2, 9, 9, 9, 1, 2]
    assert find_continuation(tokens, max_ngram=2, k=2) == [9, 9]
    assert len(find_continuation(tokens, max_ngram=2, k=50)) <= 50


def test_min_ngram_respected():
    assert find_continuation([4, 1, 2, 4], max_ngram=3, k=2, min_ngram=2) == []
    assert find_continuation([4, 1, 2, 4], max_ngram=3, k=2, min_ngram=1) == [1, 2]


def test_multiple_candidates_distinct_recent_first():
    tokens = [3, 1, 3, 2, 3, 1, 3]
    assert find_continuations(tokens, max_ngram=1, k=1, max_candidates=3) == [[1], [2]]
