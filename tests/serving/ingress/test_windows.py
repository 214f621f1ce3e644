"""serving/ingress/windows.py: a key's spend per UTC day and month, and its budget's refusal."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from serving.ingress.windows import BUDGET, DAY, MONTH, Spend, SpendBook, period_bounds


def ts(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


@pytest.mark.parametrize(
    "period,now,start,end,name",
    [
        (DAY, "2026-12-07T13:05:00", "2026-12-07T00:00:00", "2026-12-08T00:00:00", "day:2026-12-07"),
        (MONTH, "2026-12-07T13:05:00", "2026-12-01T00:00:00", "2027-01-01T00:00:00", "month:2026-12"),
        (MONTH, "2027-02-28T23:59:59", "2027-02-01T00:00:00", "2027-03-01T00:00:00", "month:2027-02"),
        (DAY, "2026-12-31T23:59:59", "2026-12-31T00:00:00", "2027-01-01T00:00:00", "day:2026-12-31"),
    ],
)
def test_periods_are_utc_calendar_days_and_months(period, now, start, end, name):
    assert period_bounds(period, ts(now)) == (ts(start), ts(end), name)


def test_a_budget_refuses_once_the_periods_spend_reached_it_until_the_period_ends():
    book = SpendBook()
    now = ts("2026-12-07T22:00:00")
    book.add("k", now, Spend(4.0, 1, 100, 10, 0))
    assert book.refusal("k", 5.0, DAY, now) is None  # $4 of $5: the next request is admitted
    book.add("k", now + 1, Spend(1.5, 1, 100, 10, 0))  # that one took it past
    refused = book.refusal("k", 5.0, DAY, now + 2)
    assert refused is not None and not refused.ok and refused.limit == BUDGET
    assert refused.retry_after_s == 2 * 3600 - 2  # until midnight UTC
    assert "$5.50 of its daily budget of $5.00" in refused.message and "2026-12-08T00:00:00Z" in refused.message
    # The next day starts from zero; the month goes on counting.
    tomorrow = ts("2026-12-08T00:00:01")
    assert book.refusal("k", 5.0, DAY, tomorrow) is None
    assert book.refusal("k", 5.0, MONTH, tomorrow) is not None
    assert book.spent("k", MONTH, tomorrow) == Spend(5.5, 2, 200, 20, 0)


def test_keys_spend_apart_and_a_report_names_each_periods_bounds():
    book = SpendBook()
    now = ts("2026-12-07T10:00:00")
    book.add("a", now, Spend(1.0, 1, 5, 6, 2))
    report = book.report("b", now)
    assert report[DAY] == {
        "start": "2026-12-07T00:00:00Z",
        "end": "2026-12-08T00:00:00Z",
        "usd": 0.0,
        "requests": 0,
        "prompt": 0,
        "completion": 0,
        "cached": 0,
    }
    assert book.report("a", now)[MONTH]["usd"] == 1.0 and book.report("a", now)[MONTH]["cached"] == 2


def test_tidying_keeps_the_current_periods_and_export_load_round_trips():
    book = SpendBook()
    book.add("k", ts("2026-11-30T23:00:00"), Spend(2.0, 1, 1, 1, 0))
    now = ts("2026-12-01T01:00:00")
    book.add("k", now, Spend(3.0, 1, 1, 1, 0))
    book.tidy(now)
    assert book.spent("k", MONTH, now).usd == 3.0 and len(book.export()) == 2  # today's and December's
    other = SpendBook()
    other.load(book.export())
    other.load(book.export())  # a take-over adds
    assert other.spent("k", DAY, now).usd == 6.0


def test_adding_spend_keeps_every_count_and_a_short_row_counts_its_missing_values_as_zero():
    total = Spend(0.5, 1, 10, 4, 2).plus(Spend(0.25, 1, 6, 3, 6))
    assert total == Spend(0.75, 2, 16, 7, 8)
    assert total.plus([0.25, 1]) == Spend(1.0, 3, 16, 7, 8)  # a row without tokens
