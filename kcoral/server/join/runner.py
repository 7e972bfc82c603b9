# -*- test-case-name: tests.unit.test_join -*-
"""
One claimed job, from the node's own server to the gateway.

L{JobRunner.run} POSTs the job's program to the node's C{/execute} on
loopback (L{kcoral.server.join.local}).  A CACHE_MISS names the blobs the
node lacks: they are fetched from the gateway with the job's token and
hash-checked (L{kcoral.server.join.transfer}), then the program is sent
again with them.  Whatever the node's server answered (a result, an
error, a 503) is posted to the gateway as the job's result.  A blob that
fails its check is never used: the job ends with an C{engine} error and
the program does not run.
"""

from __future__ import annotations

import attrs
from twisted.internet.defer import Deferred, FirstError, gatherResults
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from kcoral.gateway.jobs import BlobRef, JobMessage
from kcoral.server.join.local import LocalResponse, LocalServer, missing_blobs
from kcoral.server.join.transfer import BlobRefused, GatewayLink
from kcoral.wire.errors import error_body, http_status
from kcoral.wire.jsontext import json_dumps

__all__ = ["JobRunner", "error_response"]

#: Times a program is sent again after fetching what a CACHE_MISS named
#: (the node's cache may evict a fetched blob before the next POST).
CACHE_MISS_ROUNDS = 3


def error_response(request_id: str, kind: str, message: str) -> LocalResponse:
    """An ERROR response the node gives in place of its server's (protocol §9.2)."""
    return LocalResponse(
        status=http_status(kind),
        content_type="application/json",
        body=json_dumps(error_body(request_id, kind, message)),
    )


@attrs.define(eq=False)
class JobRunner:
    """Runs claimed jobs on the node's server and posts their results."""

    local: LocalServer
    link: GatewayLink
    _clock: IReactorTime

    log = Logger()

    async def run(self, job: JobMessage) -> None:
        """Run C{job} and post its result; errors are logged, never raised."""
        started = self._clock.seconds()
        response = await self.respond(job)
        try:
            code = await self.link.post_result(job, response)
        except Exception as e:
            self.log.error(
                "job {job}: result not delivered: {error}",
                kcoral_event="join_result_lost",
                job=job.job,
                request_id=job.request_id,
                error=str(e),
            )
            return
        if not 200 <= code < 300:
            self.log.error(
                "job {job}: the gateway refused its result ({gateway_status})",
                kcoral_event="join_result_refused",
                job=job.job,
                request_id=job.request_id,
                gateway_status=code,
            )
            return
        self.log.info(
            "job {job} finished: {status}, result posted ({gateway_status})",
            kcoral_event="join_job_finished",
            job=job.job,
            request_id=job.request_id,
            status=response.status,
            gateway_status=code,
            bytes=len(response.body),
            elapsed_ms=round((self._clock.seconds() - started) * 1000.0, 3),
        )

    async def respond(self, job: JobMessage) -> LocalResponse:
        """The response to post for C{job}."""
        manifest = {blob.sha256: blob for blob in job.blobs}
        blobs: dict[str, bytes] = {}
        try:
            for _ in range(CACHE_MISS_ROUNDS + 1):
                response = await self.local.execute(job.request_id, job.program, blobs, job.options)
                missing = missing_blobs(response)
                if missing is None:
                    return response
                unlisted = [digest for digest in missing if digest not in manifest]
                if unlisted:
                    return error_response(
                        job.request_id,
                        "engine",
                        f"the job lacks blob {unlisted[0]} that its program references",
                    )
                wanted = [digest for digest in missing if digest not in blobs]
                blobs.update(zip(wanted, await self._fetch_all(job, wanted, manifest), strict=True))
            return error_response(
                job.request_id, "engine", "the node's cache kept missing the job's blobs"
            )
        except BlobRefused as e:
            self.log.error(
                "job {job}: blob {sha256} refused: {reason}; the program does not run",
                kcoral_event="join_blob_refused",
                job=job.job,
                request_id=job.request_id,
                sha256=e.sha256,
                reason=e.reason,
            )
            return error_response(
                job.request_id, "engine", f"blob {e.sha256} from the gateway refused: {e.reason}"
            )
        except Exception as e:
            self.log.failure(
                "job {job}: the node's server could not run it",
                job=job.job,
                request_id=job.request_id,
            )
            return error_response(
                job.request_id, "engine", f"node failed: {type(e).__name__}: {e}"[:500]
            )

    async def _fetch_all(
        self, job: JobMessage, digests: list[str], manifest: dict[str, BlobRef]
    ) -> list[bytes]:
        """The blobs C{digests}, fetched side by side; the first failure raised."""
        try:
            fetched: list[bytes] = await gatherResults(
                [
                    Deferred.fromCoroutine(self.link.fetch_blob(job, manifest[digest]))
                    for digest in digests
                ],
                consumeErrors=True,
            )
        except FirstError as e:
            raise e.subFailure.value from None  # type: ignore[union-attr,misc]
        return fetched
