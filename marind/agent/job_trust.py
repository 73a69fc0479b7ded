"""Which jobs an agent agrees to run: only signed ones, when its config says so (docs/design.md §2, §8).

With ``[agent] require_signed_jobs = true``, before a job's torchrun is started the agent reads
``{p}/jobs/{job}/signature`` and verifies it against the stored spec and its ``trusted_keys``
(``marind.control.job_signing.verify``). A job that fails is refused: the agent whose write
moves it to FAILED (reason ``refused: ...``) appends a ``job_refused`` event, and no node
starts anything for it. Without the setting every job is admitted, as before.

The daemon calls ``JobTrust.admits`` where it picks up a new job (``Agent._maybe_start``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from marind.control.events import JOB_REFUSED, append_event
from marind.control.job_records import JobView, signature_key, update_state
from marind.control.lifecycle import JobEvent
from marind.core.errors import ControlPlaneUnavailable
from marind.core.log import get_logger

if TYPE_CHECKING:
    from marind.agent.link import Link
    from marind.control.config import AgentConfig
    from marind.core.etcd_client import EtcdClient


def refuse(client: EtcdClient, job: str, node: str, reason: str, key_id: str | None) -> bool:
    """Move ``job`` to FAILED with ``refused: {reason}``; the agent whose move it was writes the event.

    Returns:
        True when this call moved the job (and wrote ``job_refused``).
    """
    new = update_state(client, job, JobEvent.FAILED, reason=f"refused: {reason}")
    if new is None:
        return False         # terminal already: another agent refused it first
    append_event(client, job, JOB_REFUSED, node, {"reason": reason, "key_id": key_id})
    return True


@dataclass
class JobTrust:
    """The agent's rule for starting jobs.

    Args:
        required: ``[agent] require_signed_jobs``.
        trusted: the public keys of ``[agent] trusted_keys``, by key id.
        node: this node's name (the event names it).
    """

    required: bool = False
    trusted: dict[str, Any] = field(default_factory=dict)
    node: str = ""
    refused: set[str] = field(default_factory=set)       # jobs this agent refused (never looked at again)
    verified: set[tuple[str, int]] = field(default_factory=set)   # (job, spec revision) found signed

    @classmethod
    def from_config(cls, config: AgentConfig) -> JobTrust:
        """Read the trusted keys (``SpecError`` at the agent's start for a missing or bad file)."""
        if not config.trusted_keys:
            return cls(required=config.require_signed_jobs, node=config.node)
        from marind.control.job_signing import load_trusted  # cryptography: only when keys are set
        return cls(required=config.require_signed_jobs, trusted=load_trusted(config.trusted_keys),
                   node=config.node)

    def admits(self, view: JobView, link: Link) -> bool:
        """May this node start ``view`` now? False for a refused job (refused here, once) and while
        its signature cannot be read (etcd away: asked again on a later tick)."""
        if not self.required:
            return True
        if view.id in self.refused:
            return False
        if (view.id, view.submitted_rev) in self.verified:   # a job waiting for slots: checked once
            return True
        log = get_logger(__name__, node=self.node, job=view.id)
        try:
            record = link.client.get_json(signature_key(link.client, view.id))
        except ControlPlaneUnavailable as exc:
            log.warning("job_signature_unread", error=str(exc), action="asked again next tick")
            return False
        ok, why = self.verify(view, record)
        if ok:
            log.info("job_signature_ok", key_id=why)
            self.verified.add((view.id, view.submitted_rev))     # a spec written anew is checked anew
            return True
        self.refused.add(view.id)
        key_id = record.get("key_id") if isinstance(record, dict) else None
        log.error("job_refused", reason=why, key_id=key_id, action="job fails, nothing started")
        link.outbox.put(view.id, lambda: refuse(link.client, view.id, self.node, why, key_id))
        return False

    def verify(self, view: JobView, record: Any) -> tuple[bool, str]:
        """(True, key id) when ``record`` is a good signature of the stored spec by a trusted key, else (False, why)."""
        from marind.control.job_signing import verify
        return verify(view.id, view.spec, record, self.trusted)
