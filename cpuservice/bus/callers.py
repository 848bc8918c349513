"""Who is calling the Manager, and what they may do: the caller's uid from the bus, polkit's
answer for an action, the per-user rate of changes (a mixin of cpuservice.bus.api.Manager)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from dbus_fast.aio import MessageBus

from cpuservice.bus.objects import current_call
from cpuservice.host import dbuscall, journal
from cpuservice.host.authz import ALLOCATE, MANAGE, Authority, BusyError, RateLimit
from cpuservice.model.errors import AccessDenied, CPUServiceError, LimitExceeded
from cpuservice.shell.service import Service


class Callers:
    """The Manager's checks of its callers (it sets these attributes)."""

    service: Service
    bus: MessageBus
    authority: Authority
    rate: RateLimit
    _uids: OrderedDict[str, int]
    _asking: dict[str, asyncio.Future[int]]  # uids being asked of the bus

    async def authorize(self, action: str) -> int:
        """The caller's uid, once polkit allows ``action`` (uid 0 needs no asking)."""
        uid = await self._caller_uid()
        sender, interactive = current_call.get()
        await self.authority.check(sender, uid, action, interactive)
        journal.CALLER.set(uid)  # the audit trail names who asked (this call's task only)
        return uid

    async def authorize_for(self, name: str) -> tuple[int, int]:
        """Work on an existing allocation: allocate for one's own, manage for anyone's.
        Returns the caller's uid and the allocation's serial: the service acts only if the
        name still means that allocation once it holds its lock."""
        serial = self.service.serial(name)
        owner = self.service.record(name).owner
        uid = await self._caller_uid()
        return await self.authorize(ALLOCATE if owner == uid else MANAGE), serial

    async def count_change(self, uid: int) -> None:
        """One more change by ``uid`` (RateLimit); LimitExceeded past the limit, unless the
        caller is exempt (root, manage)."""
        if uid == 0:
            return
        try:
            self.rate.take(uid)
        except BusyError as exc:
            if not await self.exempt(uid):
                raise LimitExceeded(str(exc)) from None

    async def exempt(self, uid: int) -> bool:
        """Whether the per-user limits spare this caller: root, or a holder of manage
        (asked without interaction: a limit is no reason to prompt)."""
        if uid == 0:
            return True
        try:
            await self.authority.check(current_call.get()[0], uid, MANAGE, False)
        except CPUServiceError:
            return False
        return True

    async def _caller_uid(self) -> int:
        """The caller's uid from the bus."""
        sender = current_call.get()[0]
        if not sender:  # only a peer-to-peer connection has none: not the system bus's word
            raise AccessDenied("a call that names no sender is not accepted")
        return await self.uid_of(sender)

    async def uid_of(self, sender: str) -> int:
        """The uid of a bus connection, asked of the bus once (unique names are never reused:
        cached; the calls pipelined on a new connection wait for one answer)."""
        if sender in self._uids:
            return self._uids[sender]
        asking = self._asking.get(sender)
        if asking is None:
            asking = self._asking[sender] = asyncio.ensure_future(self._ask_uid(sender))
            asking.add_done_callback(lambda _: self._asking.pop(sender, None))
        return await asyncio.shield(asking)

    async def _ask_uid(self, sender: str) -> int:
        try:
            (uid,) = await dbuscall.call(self.bus, *dbuscall.BUS, "GetConnectionUnixUser", "s",
                                         [sender])
        except dbuscall.CallError:
            raise AccessDenied("the caller's uid is unknown") from None
        self._uids[sender] = int(uid)
        while len(self._uids) > 4096:
            self._uids.popitem(last=False)
        return int(uid)
