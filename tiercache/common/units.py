"""Units shared across the library, named once so that a conversion reads as what it means."""

MS_PER_SECOND = 1000.0
"""Milliseconds in a second: options and stats speak milliseconds, clocks and asyncio seconds."""
US_PER_SECOND = 1_000_000.0
"""Microseconds in a second: socket timeouts (``timeval``) and copy-time stats (``*_us``) speak microseconds."""
