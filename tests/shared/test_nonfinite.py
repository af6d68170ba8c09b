"""first_nonfinite names the first tensor holding NaN or Inf, across dtypes, or None."""

import math

import pytest
import torch

from shared.nonfinite import finite_rows, first_nonfinite


def _tensors() -> dict[str, torch.Tensor]:
    return {
        "a32": torch.randn(4, 8),
        "b16": torch.randn(3, 5, dtype=torch.float16),
        "c32": torch.randn(8, 2),
        "dbf": torch.randn(2, 2, dtype=torch.bfloat16),
    }


def test_finite_tensors_of_mixed_dtypes_pass():
    assert first_nonfinite(_tensors()) is None


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("name", ["a32", "b16", "c32", "dbf"])
def test_the_tensor_holding_a_nonfinite_value_is_named(name, value):
    tensors = _tensors()
    tensors[name][1, 1] = value
    assert first_nonfinite(tensors) == name


def test_of_several_bad_tensors_the_first_in_mapping_order_is_named():
    tensors = _tensors()
    tensors["dbf"][0, 0] = math.nan
    tensors["b16"][2, 4] = math.inf
    assert first_nonfinite(tensors) == "b16"


def test_finite_values_whose_sum_overflows_are_not_mistaken_for_inf():
    big = torch.full((4, 4), 3e38)  # float32 max is 3.4e38: the sum overflows, no value does
    assert first_nonfinite({"big": big, "small": torch.ones(2, 2)}) is None
    big[3, 3] = math.nan
    assert first_nonfinite({"big": big, "small": torch.ones(2, 2)}) == "big"


def test_no_tensors_hold_nothing_nonfinite():
    assert first_nonfinite({}) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finite_rows_names_each_row_holding_nan_or_inf(dtype):
    matrix = torch.randn(5, 7, dtype=dtype)
    matrix[1, 3], matrix[3, 0], matrix[4, 6] = math.nan, math.inf, -math.inf
    assert finite_rows(matrix) == [True, False, True, False, False]


def test_a_row_whose_sum_overflows_is_still_finite():
    matrix = torch.full((3, 4), 3e38)  # each row's sum overflows float32, no value does
    matrix[2, 1] = math.nan
    assert finite_rows(matrix) == [True, True, False]


def test_a_matrix_without_rows_has_no_finite_rows_to_name():
    assert finite_rows(torch.empty(0, 4)) == []
