"""
Suite-wide setup.

The suite runs trial TestCases on Twisted's global reactor, so it installs
that reactor before any test runs: a blocking L{kcoral.Client} used in this
process then finds it installed and idle and runs a private reactor of its
own (docs/client.md, "Which reactor"), instead of installing and running the
global one in crochet's thread, which would leave no reactor for the trial
tests that come after it.
"""

from twisted.internet import reactor  # noqa: F401
