"""Planning the packing of a group's completions into fewer rows (jgrpo.packing)."""

import numpy as np
import pytest

from jgrpo.packing import (
    completion_lengths,
    first_fit,
    pack_completions,
    packed_row_counts,
    rows_needed,
)


def test_packed_row_counts_are_up_to_four_multiples_of_a_quarter_group():
    assert packed_row_counts(1) == (1,)
    assert packed_row_counts(2) == (1, 2)
    assert packed_row_counts(3) == (1, 2, 3)
    assert packed_row_counts(8) == (2, 4, 6, 8)
    assert packed_row_counts(10) == (3, 6, 9, 10)
    assert packed_row_counts(16) == (4, 8, 12, 16)


def test_first_fit_places_the_longest_first_into_the_first_row_with_room():
    # 3 -> row 0; 2 does not fit row 0's last slot -> row 1; 1 fills row 0
    assert first_fit(np.array([3, 1, 2]), 4) == [(0, 0), (0, 3), (1, 0)]
    assert first_fit(np.array([4, 4, 0]), 4) == [(0, 0), (1, 0), (0, 4)]
    with pytest.raises(ValueError, match="a completion of 5 tokens does not fit 4 slots"):
        first_fit(np.array([5]), 4)


def test_rows_needed_is_the_most_any_group_needs():
    lengths = np.array([3, 1, 2, 1, 1, 1, 4, 4, 4])  # groups of 3: 2, 1 and 3 rows of 4 slots
    assert rows_needed(lengths, 3, 4) == 3
    assert rows_needed(lengths[:6], 3, 4) == 2
    assert rows_needed(np.zeros(6, int), 3, 4) == 1


def test_pack_completions_sources_and_predictors():
    packed = pack_completions(
        np.array([3, 1, 2]), group_size=3, width=4, rows_per_group=2, prompt_length=2
    )
    # row 0 holds completion 0's tokens 0-2 and completion 1's token 0 (group token 1 * 4 + 0);
    # row 1 holds completion 2's two tokens (2 * 4 + 0, 2 * 4 + 1)
    np.testing.assert_array_equal(packed.source, [[0, 1, 2, 4], [8, 9, -1, -1]])
    # a token's predictor is its previous token's slot (prompt columns 0-1, then row 0 at
    # slots 2-5 and row 1 at 6-9); token 0's and padding's are the prompt's last column, 1
    np.testing.assert_array_equal(packed.predictor, [[1, 2, 3, 1], [1, 1, 1, 1], [1, 6, 1, 1]])
    assert packed.source.dtype == packed.predictor.dtype == np.int32


def test_pack_completions_packs_each_group_on_its_own():
    lengths = np.array([2, 2, 1, 1])  # two groups of 2: one packed row of 4 slots each
    packed = pack_completions(lengths, group_size=2, width=4, rows_per_group=2, prompt_length=1)
    np.testing.assert_array_equal(packed.source, [[0, 1, 4, 5], [-1] * 4, [0, 4, -1, -1], [-1] * 4])
    np.testing.assert_array_equal(packed.predictor, [[0, 1, 0, 0], [0, 3, 0, 0], [0] * 4, [0] * 4])
    with pytest.raises(ValueError, match="group 0's completions need more than rows_per_group=1"):
        pack_completions(np.array([3, 2]), group_size=2, width=4, rows_per_group=1, prompt_length=1)


def test_completion_lengths_needs_right_padding():
    mask = np.array([[1, 1, 0], [0, 0, 0], [1, 1, 1]], bool)
    np.testing.assert_array_equal(completion_lengths(mask), [2, 0, 3])
    with pytest.raises(ValueError, match="pack_completions needs right-padded completions"):
        completion_lengths(np.array([[1, 0, 1]], bool))
