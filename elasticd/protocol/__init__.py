"""Every message of the control plane: one dataclass per message type, msgpack on the wire.

`wire` holds the envelope (version, request id), decoding with validation, and the error replies;
the messages are grouped by who talks: `requests` (CLI), `status` and `events` (what the CLI reads),
`nodes` (daemon <-> scheduler), `agents` (agent <-> daemon), `federation` (island schedulers <-> a
federation front) and `spans` (jobs spanning islands). Everything is re-exported here: ``from elasticd import protocol as p``.

One name per count: the CLI, the scheduler and the daemons count a job's agents as `devices` (one agent
per device; `devices_from` before a resize); the messages to an agent say `world`, as torch.distributed
names the size of the agents' own process group. Payloads are typed records or maps of scalars, checked
at decoding; no field holds an untyped map.
"""

from __future__ import annotations

from elasticd.protocol.agents import (  # noqa: F401
    COMMANDS,
    EVENTS,
    AgentCommand,
    AgentDone,
    AgentError,
    AgentEvent,
    AgentFailed,
    AgentHello,
    AgentInfo,
    AgentJoin,
    AgentResize,
    AgentResized,
    AgentResizeRefused,
    AgentStep,
    AgentStop,
    RefusedInfo,
    ResizedInfo,
)
from elasticd.protocol.events import Event, Events, EventsReply  # noqa: F401
from elasticd.protocol.federation import (  # noqa: F401
    IslandAck,
    IslandBye,
    IslandCapacity,
    IslandHello,
    IslandInfo,
    IslandsReply,
    IslandStatus,
    ListIslands,
)
from elasticd.protocol.nodes import (  # noqa: F401
    AbortResize,
    AgentReport,
    DeviceInfo,
    JobReport,
    KillJob,
    LaunchJob,
    NodeAck,
    NodeBye,
    NodeHello,
    NodeStatus,
    PrepareResize,
    RankPlacement,
    ResizeJob,
    Welcome,
    bad_blocks,
)
from elasticd.protocol.requests import (  # noqa: F401
    Drain,
    Logs,
    LogsReply,
    Scale,
    ScaleAt,
    Shutdown,
    Stop,
    Submit,
    Submitted,
    Undrain,
)
from elasticd.protocol.spans import (  # noqa: F401
    MAX_SPAN_ISLANDS,
    AbortPortionMove,
    CancelPortion,
    GoPortion,
    ListSpans,
    MovePortion,
    PortionInfo,
    PortionRow,
    PortionSpec,
    ReservePortion,
    SpanInfo,
    SpansReply,
    SpanSubmitted,
    StartPortion,
    SubmitSpanning,
)
from elasticd.protocol.status import (  # noqa: F401
    AgentRow,
    DrainInfo,
    JobInfo,
    JobLayout,
    LayoutAgent,
    NodeInfo,
    ResizeInFlight,
    Status,
    StatusReply,
)
from elasticd.protocol.wire import (  # noqa: F401
    BAD_FRAME,
    BAD_REQUEST,
    BUSY,
    FORBIDDEN,
    INTERNAL,
    INVALID_STATE,
    MAX_FRAME_BYTES,
    MAX_TEXT_CHARS,
    PROTOCOL_VERSION,
    QUOTA,
    SCHEDULER_UNREACHABLE,
    TOO_LARGE,
    UNEXPECTED,
    UNKNOWN_JOB,
    UNKNOWN_NODE,
    UNKNOWN_OP,
    VERSION_MISMATCH,
    Error,
    Message,
    Ok,
    ProtocolError,
    Scalar,
    decode,
    encoded_size,
    error_from,
    flat_metrics,
    flat_scalars,
    from_dict,
    message,
    peek_op,
    peek_rid,
    plain,
    record,
    registered_ops,
)
