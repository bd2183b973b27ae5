-- Admission control measures where attempts wait, not only how many finish.
--
-- in_flight_ms: the milliseconds each answered attempt was in flight, from
--   its dispatch to the reply (database clock), summed. Over a window,
--   divided by its length: how many attempts the agent had on average.
-- queued_ms: of those, the milliseconds the attempts queued before their
--   first call (the agent queue and the agent's call slots), as the agents
--   report them in StepReply.queued_ms, summed. Over a window: how many
--   queued on average.
-- slot_wait_ms: the milliseconds they waited for the agents' call slots
--   (StepReply.slot_wait_ms), summed: while attempts wait for slots, the
--   remote service is what holds them up.
-- window_in_flight_ms, window_queued_ms, window_slot_wait_ms: their values
--   when the current window started, as window_settled for settled.
-- The supervisors' control law then keeps the backlog in the agent's line,
-- where urgent orders go first, rather than in the agent queue
-- (crates/store/src/machine/admission.rs).
ALTER TABLE admission
    ADD COLUMN in_flight_ms bigint NOT NULL DEFAULT 0,
    ADD COLUMN queued_ms bigint NOT NULL DEFAULT 0,
    ADD COLUMN slot_wait_ms bigint NOT NULL DEFAULT 0,
    ADD COLUMN window_in_flight_ms bigint NOT NULL DEFAULT 0,
    ADD COLUMN window_queued_ms bigint NOT NULL DEFAULT 0,
    ADD COLUMN window_slot_wait_ms bigint NOT NULL DEFAULT 0;
