-- `corral profiles` reads when each profile last succeeded end to end.
CREATE INDEX executions_profile_state ON executions (profile_ref, state, finished_at_ms);
