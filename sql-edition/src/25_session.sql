/*-------------------------------------------------------------------------
 *
 * 25_session.sql
 *	  Session-bound claims: a pending key tied to the session that claimed it.
 *
 * Mirrors session.c: _session_binding names this session by its pid and
 * its backend's start, and _session_alive asks the server's activity list
 * whether the session with such a binding still runs.  The SQL edition
 * holds no lock for a binding, so a claim or a sweep asks when it meets
 * the key; where the list does not show the backend, the lease decides.
 *
 *-------------------------------------------------------------------------
 */

/* ---------------------------------------------------------------------
 * Session-bound claims (session.c)
 * ---------------------------------------------------------------------
 */

/*
 * This session's binding: its pid and the millisecond its backend started,
 * as one number (pid << 41 | start mod 2^41).  No two sessions alive at
 * once share it, and a session that ended is recognised by it: no backend
 * with that pid started at that moment any more.
 */
CREATE OR REPLACE FUNCTION idempotency._session_binding()
RETURNS bigint
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
RETURN (SELECT (a.pid::bigint OPERATOR(pg_catalog.<<) 41) OPERATOR(pg_catalog.|)
			   (pg_catalog.floor(EXTRACT(epoch FROM a.backend_start) OPERATOR(pg_catalog.*) 1000)::bigint
				OPERATOR(pg_catalog.&) 2199023255551)
		  FROM pg_catalog.pg_stat_get_activity(pg_catalog.pg_backend_pid()) a);

/*
 * Is the session with binding "b" alive?  Asked of the server's activity
 * list, read afresh (it is otherwise cached for the transaction).  When
 * the list does not show that backend's start (no privilege), the session
 * counts as alive: its lease still ends.
 */
CREATE OR REPLACE FUNCTION idempotency._session_alive(b bigint)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	pid integer := (b OPERATOR(pg_catalog.>>) 41)::integer;
	start_ms bigint := b OPERATOR(pg_catalog.&) 2199023255551;
	started timestamptz;
BEGIN
	IF pid OPERATOR(pg_catalog.=) pg_catalog.pg_backend_pid() THEN
		RETURN b OPERATOR(pg_catalog.=) idempotency._session_binding();
	END IF;
	IF pid OPERATOR(pg_catalog.<=) 0 THEN
		RETURN false;
	END IF;
	PERFORM pg_catalog.pg_stat_clear_snapshot();
	SELECT a.backend_start INTO started
	  FROM pg_catalog.pg_stat_get_activity(pid) a;
	IF NOT FOUND THEN
		RETURN false;
	END IF;
	IF started IS NULL THEN
		RETURN true;
	END IF;
	RETURN (pg_catalog.floor(EXTRACT(epoch FROM started) OPERATOR(pg_catalog.*) 1000)::bigint
			OPERATOR(pg_catalog.&) 2199023255551) OPERATOR(pg_catalog.=) start_ms;
END;
$$;
