"""The island scheduler: a job table and a placement policy (pure, synchronous), and the ZeroMQ
server around them. See `state.SchedulerState` for the event/action core."""
