"""rota's own fields in the snapshot_agent.v1alpha1 messages (an extension), shared by the agent and its clients.

``ext`` is the generated code of ``agent_ext.proto``: each ``*Ext`` message travels inside
the bytes of the v1alpha1 message it is named after, with field numbers from 1000 up,
which v1alpha1 peers keep as unknown fields and ignore. :func:`attach` appends them,
:func:`read` reads them back.
"""

from __future__ import annotations

from typing import TypeVar

from google.protobuf.message import Message

from rota_agent_client._generated import agent_ext_pb2 as ext

__all__ = ["REGISTERED", "attach", "ext", "read"]

M = TypeVar("M", bound=Message)
REGISTERED = "rota-registered"  # initial metadata of a WorkloadChannel the agent accepted


def attach(msg: M, extra: Message) -> M:
    """``msg`` with ``extra``'s fields (numbered 1000+) appended; v1alpha1 peers keep them as unknown fields."""
    return type(msg).FromString(msg.SerializeToString() + extra.SerializeToString())


def read(msg: Message, kind: type[M]) -> M:
    """The rota-owned fields of ``msg``, parsed as ``kind`` (empty when the peer sent none)."""
    return kind.FromString(msg.SerializeToString())
