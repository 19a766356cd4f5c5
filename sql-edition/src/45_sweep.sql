/*-------------------------------------------------------------------------
 *
 * 45_sweep.sql
 *	  idem_sweep: expiring and resetting keys.
 *
 * Mirrors sweep.c: _sweep_one deletes, resets or reschedules one candidate
 * row version, skipping any that another transaction is changing or
 * locking, and idem_sweep runs one batch of each kind.  The SQL edition
 * has no background worker (worker.c), so the application or pg_cron
 * calls idem_sweep.
 *
 *-------------------------------------------------------------------------
 */

/* ---------------------------------------------------------------------
 * Sweeping (sweep.c)
 * ---------------------------------------------------------------------
 */

/*
 * Sweep one candidate row version "t" of (scope, key): skipped when its
 * lock is taken, when another transaction is changing or locking it, when
 * our own open transaction is claiming it, or when it changed since the
 * candidate query.  Returns 'expired', 'reset', 'rescheduled' or NULL.
 * "only_ended": a key of a session that ended that needs neither a delete
 * nor a reset is left alone.
 */
CREATE OR REPLACE FUNCTION idempotency._sweep_one(t tid, p_scope text, p_key text,
	now timestamptz, do_expire boolean, do_reset boolean, only_ended boolean)
RETURNS text
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	h integer := idempotency._key_hash(p_scope, p_key);
	p record;
	runs boolean;
	done text;
	n bigint;
BEGIN
	IF NOT pg_catalog.pg_try_advisory_lock(idempotency._lock_class(), h) THEN
		RETURN NULL;
	END IF;
	BEGIN
		SELECT * INTO p FROM idempotency._probe(p_scope, p_key);
		IF p.present AND NOT p.busy AND p.tid OPERATOR(pg_catalog.=) t
		   AND NOT (p.mine AND p.status OPERATOR(pg_catalog.=) 'pending') THEN
			runs := p.status OPERATOR(pg_catalog.=) 'pending' AND p.token IS NOT NULL AND
				p.lease_until OPERATOR(pg_catalog.>) now AND
				(p.owner_session IS NULL OR idempotency._session_alive(p.owner_session));
			IF p.expires_at OPERATOR(pg_catalog.<=) now AND NOT runs THEN
				IF do_expire THEN
					DELETE FROM idempotency.keys k
					 WHERE k.ctid OPERATOR(pg_catalog.=) t;
					GET DIAGNOSTICS n = ROW_COUNT;
					done := 'expired';
				END IF;
			ELSIF p.status OPERATOR(pg_catalog.=) 'pending' AND p.token IS NOT NULL AND NOT runs THEN
				IF do_reset THEN
					UPDATE idempotency.keys k
					   SET token = NULL, sweep_at = p.expires_at, owner_session = NULL
					 WHERE k.ctid OPERATOR(pg_catalog.=) t;
					GET DIAGNOSTICS n = ROW_COUNT;
					done := 'reset';
				END IF;
			ELSIF NOT only_ended THEN
				UPDATE idempotency.keys k
				   SET sweep_at = CASE WHEN runs THEN p.lease_until ELSE p.expires_at END
				 WHERE k.ctid OPERATOR(pg_catalog.=) t;
				GET DIAGNOSTICS n = ROW_COUNT;
				done := 'rescheduled';
			END IF;
			IF n OPERATOR(pg_catalog.=) 0 THEN
				-- the version was replaced by a change that committed since
				-- the probe: skipped, and the lock the statement took on the
				-- newest version while it looked for ours is rolled back
				RAISE EXCEPTION 'version gone' USING ERRCODE = 'IDW03';
			END IF;
		END IF;
	EXCEPTION
		WHEN serialization_failure OR SQLSTATE 'IDW03' THEN
			done := NULL;		-- changed since our snapshot: skipped
		WHEN OTHERS OR query_canceled THEN
			PERFORM pg_catalog.pg_advisory_unlock(idempotency._lock_class(), h);
			RAISE;
	END;
	PERFORM pg_catalog.pg_advisory_unlock(idempotency._lock_class(), h);
	RETURN done;
END;
$$;

/*
 * Delete keys past their retention and reset pending keys whose lease
 * ended (or whose session ended), at most batch_size of each kind; keys
 * found before their time are rescheduled on the way.  Never waits: rows
 * that others are changing or locking are skipped.
 */
CREATE OR REPLACE FUNCTION idempotency.idem_sweep(
	batch_size	integer	DEFAULT NULL)
RETURNS TABLE (expired bigint, reset bigint)
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE ROWS 1 SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	batch integer;
	now timestamptz;
	c record;
	done text;
	progress integer;
	n integer;
	last_owner bigint;
	last_alive boolean;
BEGIN
	IF batch_size IS NOT NULL AND batch_size OPERATOR(pg_catalog.<=) 0 THEN
		RAISE EXCEPTION 'batch_size must be positive' USING ERRCODE = '22023';
	END IF;
	batch := COALESCE(batch_size,
		idempotency._guc_bytes('idempotency.sweep_batch', 1000)::integer);
	PERFORM idempotency._check_writable('idem_sweep()');
	PERFORM idempotency._check_catalog();
	now := pg_catalog.clock_timestamp();
	expired := 0;
	reset := 0;
	LOOP
		progress := 0;
		n := 0;
		FOR c IN
			SELECT k.ctid AS t, k.scope, k.key FROM idempotency.keys k
			 WHERE k.sweep_at OPERATOR(pg_catalog.<=) now
			 ORDER BY k.sweep_at
			 LIMIT LEAST(batch::bigint OPERATOR(pg_catalog.*) 2, 2147483647)
		LOOP
			n := n OPERATOR(pg_catalog.+) 1;
			EXIT WHEN expired OPERATOR(pg_catalog.>=) batch OR reset OPERATOR(pg_catalog.>=) batch;
			done := idempotency._sweep_one(c.t, c.scope, c.key, now,
				expired OPERATOR(pg_catalog.<) batch, reset OPERATOR(pg_catalog.<) batch, false);
			IF done IS NOT NULL THEN
				progress := progress OPERATOR(pg_catalog.+) 1;
			END IF;
			IF done OPERATOR(pg_catalog.=) 'expired' THEN
				expired := expired OPERATOR(pg_catalog.+) 1;
			ELSIF done OPERATOR(pg_catalog.=) 'reset' THEN
				reset := reset OPERATOR(pg_catalog.+) 1;
			END IF;
		END LOOP;
		EXIT WHEN n OPERATOR(pg_catalog.<) LEAST(batch::bigint OPERATOR(pg_catalog.*) 2, 2147483647)
			OR progress OPERATOR(pg_catalog.=) 0
			OR expired OPERATOR(pg_catalog.>=) batch OR reset OPERATOR(pg_catalog.>=) batch;
	END LOOP;
	-- the keys of sessions that ended: found through keys_owner_session_idx
	IF expired OPERATOR(pg_catalog.<) batch AND reset OPERATOR(pg_catalog.<) batch THEN
		FOR c IN
			SELECT k.ctid AS t, k.scope, k.key, k.owner_session FROM idempotency.keys k
			 WHERE k.owner_session IS NOT NULL
			 ORDER BY k.owner_session
		LOOP
			IF c.owner_session IS DISTINCT FROM last_owner THEN
				last_owner := c.owner_session;
				last_alive := idempotency._session_alive(last_owner);
			END IF;
			CONTINUE WHEN last_alive;
			EXIT WHEN expired OPERATOR(pg_catalog.>=) batch OR reset OPERATOR(pg_catalog.>=) batch;
			done := idempotency._sweep_one(c.t, c.scope, c.key, now, true, true, true);
			IF done OPERATOR(pg_catalog.=) 'expired' THEN
				expired := expired OPERATOR(pg_catalog.+) 1;
			ELSIF done OPERATOR(pg_catalog.=) 'reset' THEN
				reset := reset OPERATOR(pg_catalog.+) 1;
			END IF;
		END LOOP;
	END IF;
	RETURN NEXT;
END;
$$;

REVOKE ALL ON FUNCTION idempotency.idem_sweep(integer) FROM PUBLIC;
