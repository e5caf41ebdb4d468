"""Units shared across the library, named once so that a conversion reads as what it means."""

MS_PER_SECOND = 1000.0
"""Milliseconds in a second: options and stats speak milliseconds, clocks and asyncio seconds."""
MICROS_PER_SECOND = 1_000_000
"""Microseconds in a second: counters that sum durations keep whole microseconds."""
