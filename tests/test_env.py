"""Numbers from JAXAOT_* environment variables (``jaxaot._env``)."""

from __future__ import annotations

import pytest

from jaxaot._env import number

NAME = "JAXAOT_TEST_NUMBER"


def test_unset_or_blank_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NAME, raising=False)
    assert number(NAME, 2.5, "a number") == 2.5
    monkeypatch.setenv(NAME, "  ")
    assert number(NAME, 2.5, "a number") == 2.5


@pytest.mark.parametrize(("text", "value"), [("3", 3.0), (" 1e-3 ", 1e-3), ("inf", float("inf"))])
def test_a_number_is_read(monkeypatch: pytest.MonkeyPatch, text: str, value: float) -> None:
    monkeypatch.setenv(NAME, text)
    assert number(NAME, 0.0, "a number") == value


@pytest.mark.parametrize("text", ["soon", "1 s", "nan", "-1"])
def test_bad_text_names_the_variable_and_what_it_must_be(
    monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    monkeypatch.setenv(NAME, text)
    with pytest.raises(ValueError, match=f"{NAME} must be a non-negative number of seconds, got"):
        number(NAME, 0.0, "a non-negative number of seconds", minimum=0.0)


def test_without_a_minimum_any_number_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NAME, "-4")
    assert number(NAME, 0.0, "a number") == -4.0
