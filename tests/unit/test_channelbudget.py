"""Tests for L{kcoral.server.workers.channelbudget} and the channel's admission hooks."""

from __future__ import annotations

import json

from twisted.internet.defer import CancelledError
from twisted.trial.unittest import SynchronousTestCase

from kcoral.server.workers.channelbudget import ChannelBudget
from kcoral.wire.channel import (
    HEADER_DECODE_FACTOR,
    ChannelError,
    FrameDecoder,
    encode_frame,
    frame_cost,
    header_cost,
)


class ChannelBudgetTests(SynchronousTestCase):
    def test_try_reserve_within_the_limit(self) -> None:
        """What fits is reserved at once; what does not, is not."""
        budget = ChannelBudget(100)
        self.assertTrue(budget.try_reserve(60))
        self.assertFalse(budget.try_reserve(50))
        self.assertEqual(budget.used, 60)
        budget.release(60)
        self.assertEqual(budget.used, 0)
        self.assertEqual(budget.peak, 60)

    def test_waiters_granted_as_they_fit(self) -> None:
        """
        A waiting reservation is granted once releases make room; a large
        one waiting does not hold up a smaller one behind it.
        """
        budget = ChannelBudget(100)
        self.assertTrue(budget.try_reserve(80))
        large = budget.reserve(95)
        small = budget.reserve(20)
        self.assertNoResult(large)
        self.assertNoResult(small)
        budget.release(70)  # 10 used: the small one fits, the large one not yet
        self.successResultOf(small)
        self.assertNoResult(large)
        self.assertEqual(budget.used, 30)
        budget.release(30)
        self.successResultOf(large)
        self.assertEqual(budget.used, 95)
        self.assertEqual(budget.waiting, 0)

    def test_cancel_takes_the_request_back(self) -> None:
        """A cancelled wait is no longer granted."""
        budget = ChannelBudget(10)
        self.assertTrue(budget.try_reserve(10))
        d = budget.reserve(5)
        d.cancel()
        self.failureResultOf(d, CancelledError)
        budget.release(10)
        self.assertEqual(budget.used, 0)

    def test_over_the_limit_refused(self) -> None:
        """A reservation larger than the whole budget could never be granted."""
        self.assertRaises(ValueError, ChannelBudget(10).reserve, 11)

    def test_kept_bounded_never_waits(self) -> None:
        """What decoded messages keep is counted apart and refused past the limit."""
        budget = ChannelBudget(100)
        self.assertTrue(budget.keep(70))
        self.assertFalse(budget.keep(40))
        self.assertTrue(budget.try_reserve(100))  # frames being read: their own count
        budget.release_kept(70)
        self.assertEqual(budget.kept, 0)
        self.assertEqual(budget.decode_share, 50)


class CostTests(SynchronousTestCase):
    def test_header_cost_bounds_what_decoding_takes(self) -> None:
        """
        The estimate is at least the objects' sizes for dense shapes, and
        about the text for plain strings.
        """
        dense = ("[" + ",".join(["0"] * 1000) + "]").encode()
        self.assertGreaterEqual(header_cost(dense), 8 * 1000)
        text = json.dumps("x" * 10000).encode()
        self.assertLess(header_cost(text), 2 * len(text) + 200)
        # Counting stops past a limit; the answer is still over it.
        self.assertGreater(header_cost(dense, limit=100), 100)
        self.assertEqual(header_cost(b"xx" + dense + b"yy", 2, 2 + len(dense)), header_cost(dense))
        self.assertGreater(
            header_cost(json.dumps("\U0001f600" * 100, ensure_ascii=False).encode()), 400
        )

    def test_frame_cost(self) -> None:
        """Three times the frame, and the header's worst case up to the share."""
        self.assertEqual(frame_cost(100, 1000, 10**9), 3 * (12 + 1100) + HEADER_DECODE_FACTOR * 100)
        self.assertEqual(frame_cost(10**6, 0, 5000), 3 * (12 + 10**6) + 5000)


class DecoderHooksTests(SynchronousTestCase):
    def test_admit_holds_a_frame(self) -> None:
        """
        A frame C{admit} declines is not parsed until a later feed, when
        C{admit} lets it through; C{inspect} sees its raw header.
        """
        allowed = [False]
        asked: list[tuple[int, int]] = []
        seen: list[bytes] = []

        def admit(header_length: int, payload_length: int) -> bool:
            asked.append((header_length, payload_length))
            return allowed[0]

        def inspect(buffer: bytearray, start: int, end: int) -> None:
            seen.append(bytes(buffer[start:end]))

        decoder = FrameDecoder(admit=admit, inspect=inspect)
        frame = encode_frame({"type": "x"}, b"abc")
        self.assertEqual(decoder.feed(frame), [])
        self.assertEqual(decoder.pending, len(frame))
        allowed[0] = True
        [decoded] = decoder.feed(b"")
        self.assertEqual(decoded.payload, b"abc")
        self.assertEqual(seen, [b'{"type":"x"}'])
        self.assertEqual(asked, [(12, 3), (12, 3)])

    def test_inspect_refuses(self) -> None:
        """An C{inspect} that raises fails the decoder, as an invalid frame does."""

        def inspect(buffer: bytearray, start: int, end: int) -> None:
            raise ChannelError("too costly")

        decoder = FrameDecoder(inspect=inspect)
        self.assertRaises(ChannelError, decoder.feed, encode_frame({"type": "x"}))
        self.assertRaises(ChannelError, decoder.feed, b"")
        self.assertEqual(decoder.pending, 0)

    def test_deep_header_is_a_channel_error(self) -> None:
        """A header nested past the recursion limit is refused, not raised as it is."""
        deep = b"[" * 100000 + b"]" * 100000
        frame = len(deep).to_bytes(4, "big") + (0).to_bytes(8, "big") + deep
        self.assertRaises(ChannelError, FrameDecoder().feed, frame)
