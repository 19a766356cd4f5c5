/*-------------------------------------------------------------------------
 *
 * 45_sweep.sql
 *	  idem_sweep: expiring and resetting keys.
 *
 * Mirrors sweep.c: idem_sweep locks a batch of candidate rows without
 * waiting (skipping any that another transaction is changing or locking)
 * and _sweep_rows deletes, compacts, resets or reschedules them, a
 * statement of each kind for the whole batch.  A reset key is abandoned:
 * the sweep notifies idempotency_abandoned with its scope, so that
 * completers listening there take it over (PostgreSQL delivers a
 * notification once per transaction however often it is sent, and only
 * at commit).  The SQL edition
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
 * Sweep the row versions "tids" (candidates locked by the caller): delete
 * those past their retention whose attempt does not run, but compact a
 * remembered one (its response, recovery point and any kept request go,
 * its outcome and fingerprint stay, sweep_at moves to its remember's end,
 * which also marks it compacted), reset pending ones whose attempt ended
 * (their tokens die; a kept request stays for a completer), at most
 * "max_expire" deleted or compacted and "max_reset" reset; with
 * "reschedule", move the others' sweep_at to when they next need a look.
 * Each scope with a key reset is notified on idempotency_abandoned; keys
 * deleted or compacted notify nothing.  A pending key our own open
 * transaction claimed is left alone.  Nothing is written where the store's verdict refuses a write
 * (_refuse_write), and nothing is refused when there is nothing to write.
 * Returns how many were expired (deleted or compacted: either ends a
 * key's stored response), reset and rescheduled.
 */
CREATE OR REPLACE FUNCTION idempotency._sweep_rows(tids tid[], now timestamptz,
	max_expire bigint, max_reset bigint, reschedule boolean, verdict integer,
	OUT expired bigint, OUT reset bigint, OUT rescheduled bigint)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	c record;
	runs boolean;
	own boolean := pg_catalog.pg_current_xact_id_if_assigned() IS NOT NULL;
	snap pg_snapshot;
	x8 xid8;
	del tid[] := '{}';
	comp tid[] := '{}';
	res tid[] := '{}';
	later tid[] := '{}';
	res_scopes text[] := '{}';
	t tid;
	n bigint;
	saved jsonb;
BEGIN
	expired := 0;
	reset := 0;
	rescheduled := 0;
	IF own THEN
		snap := pg_catalog.pg_current_snapshot();
	END IF;
	FOR c IN
		SELECT k.ctid AS tid, k.xmin AS xmin_, k.scope, k.status, k.token, k.lease_until,
			   k.expires_at, k.owner_session, k.sweep_at, k.remember
		  FROM idempotency.keys k
		 WHERE k.ctid OPERATOR(pg_catalog.=) ANY (tids)
	LOOP
		IF own AND c.status OPERATOR(pg_catalog.=) 'pending' THEN
			-- a version a running transaction wrote and we see is ours
			x8 := idempotency._xid8(c.xmin_, snap);
			CONTINUE WHEN x8 IS NOT NULL AND
				pg_catalog.pg_xact_status(x8) OPERATOR(pg_catalog.=) 'in progress';
		END IF;
		runs := c.status OPERATOR(pg_catalog.=) 'pending' AND c.token IS NOT NULL AND
			c.lease_until OPERATOR(pg_catalog.>) now AND
			(c.owner_session IS NULL OR idempotency._session_alive(c.owner_session));
		IF c.expires_at OPERATOR(pg_catalog.<=) now AND NOT runs THEN
			IF expired OPERATOR(pg_catalog.>=) max_expire THEN
				CONTINUE;
			ELSIF NOT idempotency._remembered(c.status, c.expires_at, c.remember, now) THEN
				del := del OPERATOR(pg_catalog.||) c.tid;
				expired := expired OPERATOR(pg_catalog.+) 1;
			ELSIF c.sweep_at OPERATOR(pg_catalog.>) c.expires_at THEN
				-- compacted already, when its retention passed
				IF reschedule THEN
					later := later OPERATOR(pg_catalog.||) c.tid;
				END IF;
			ELSE
				comp := comp OPERATOR(pg_catalog.||) c.tid;
				expired := expired OPERATOR(pg_catalog.+) 1;
			END IF;
		ELSIF c.status OPERATOR(pg_catalog.=) 'pending' AND c.token IS NOT NULL AND NOT runs THEN
			IF reset OPERATOR(pg_catalog.<) max_reset THEN
				res := res OPERATOR(pg_catalog.||) c.tid;
				res_scopes := pg_catalog.array_append(res_scopes, c.scope);
				reset := reset OPERATOR(pg_catalog.+) 1;
			END IF;
		ELSIF reschedule THEN
			later := later OPERATOR(pg_catalog.||) c.tid;
		END IF;
	END LOOP;
	IF verdict OPERATOR(pg_catalog.<>) 0 AND pg_catalog.cardinality(del) OPERATOR(pg_catalog.+)
	   pg_catalog.cardinality(comp) OPERATOR(pg_catalog.+) pg_catalog.cardinality(res)
	   OPERATOR(pg_catalog.+) pg_catalog.cardinality(later) OPERATOR(pg_catalog.>) 0 THEN
		PERFORM idempotency._refuse_write(verdict);
	END IF;
	-- A row a trigger or rule keeps from being written (a BEFORE trigger
	-- that returns NULL) is not counted.  Where the table runs a user's
	-- code, each row is written alone, its settings set back after it
	-- (_settings_restore), so that no row's trigger runs with what an
	-- earlier row's changed.
	IF verdict OPERATOR(pg_catalog.&) 1 OPERATOR(pg_catalog.<>) 0 THEN
		expired := 0;
		reset := 0;
		rescheduled := 0;
		FOREACH t IN ARRAY del LOOP
			saved := idempotency._settings_save();
			DELETE FROM idempotency.keys k WHERE k.ctid OPERATOR(pg_catalog.=) t;
			GET DIAGNOSTICS n = ROW_COUNT;
			expired := expired OPERATOR(pg_catalog.+) n;
			PERFORM idempotency._settings_restore(saved);
		END LOOP;
		FOREACH t IN ARRAY comp LOOP
			saved := idempotency._settings_save();
			UPDATE idempotency.keys k
			   SET response_body = NULL, phase = NULL, phase_data = NULL, request = NULL,
				   sweep_at = k.expires_at OPERATOR(pg_catalog.+) k.remember
			 WHERE k.ctid OPERATOR(pg_catalog.=) t;
			GET DIAGNOSTICS n = ROW_COUNT;
			expired := expired OPERATOR(pg_catalog.+) n;
			PERFORM idempotency._settings_restore(saved);
		END LOOP;
		FOR i IN 1..pg_catalog.cardinality(res) LOOP
			saved := idempotency._settings_save();
			UPDATE idempotency.keys k
			   SET token = NULL, sweep_at = k.expires_at, owner_session = NULL
			 WHERE k.ctid OPERATOR(pg_catalog.=) res[i];
			GET DIAGNOSTICS n = ROW_COUNT;
			reset := reset OPERATOR(pg_catalog.+) n;
			PERFORM idempotency._settings_restore(saved);
			IF n OPERATOR(pg_catalog.>) 0 THEN
				PERFORM pg_catalog.pg_notify('idempotency_abandoned', res_scopes[i]);
			END IF;
		END LOOP;
		FOREACH t IN ARRAY later LOOP
			saved := idempotency._settings_save();
			UPDATE idempotency.keys k
			   SET sweep_at = CASE WHEN k.status OPERATOR(pg_catalog.=) 'pending' AND k.token IS NOT NULL
									AND k.lease_until OPERATOR(pg_catalog.>) now
								   THEN k.lease_until
								   WHEN idempotency._remembered(k.status, k.expires_at, k.remember, now)
								   THEN k.expires_at OPERATOR(pg_catalog.+) k.remember
								   ELSE k.expires_at END
			 WHERE k.ctid OPERATOR(pg_catalog.=) t;
			GET DIAGNOSTICS n = ROW_COUNT;
			rescheduled := rescheduled OPERATOR(pg_catalog.+) n;
			PERFORM idempotency._settings_restore(saved);
		END LOOP;
		RETURN;
	END IF;
	expired := 0;
	IF pg_catalog.cardinality(del) OPERATOR(pg_catalog.>) 0 THEN
		DELETE FROM idempotency.keys k WHERE k.ctid OPERATOR(pg_catalog.=) ANY (del);
		GET DIAGNOSTICS expired = ROW_COUNT;
	END IF;
	IF pg_catalog.cardinality(comp) OPERATOR(pg_catalog.>) 0 THEN
		UPDATE idempotency.keys k
		   SET response_body = NULL, phase = NULL, phase_data = NULL, request = NULL,
			   sweep_at = k.expires_at OPERATOR(pg_catalog.+) k.remember
		 WHERE k.ctid OPERATOR(pg_catalog.=) ANY (comp);
		GET DIAGNOSTICS n = ROW_COUNT;
		expired := expired OPERATOR(pg_catalog.+) n;
	END IF;
	IF pg_catalog.cardinality(res) OPERATOR(pg_catalog.>) 0 THEN
		WITH done AS (
			UPDATE idempotency.keys k
			   SET token = NULL, sweep_at = k.expires_at, owner_session = NULL
			 WHERE k.ctid OPERATOR(pg_catalog.=) ANY (res)
			RETURNING k.scope)
		SELECT pg_catalog.count(*), pg_catalog.array_agg(DISTINCT done.scope)
		  INTO reset, res_scopes
		  FROM done;
		PERFORM pg_catalog.pg_notify('idempotency_abandoned', u.scope)
		   FROM pg_catalog.unnest(res_scopes) u(scope);
	END IF;
	-- (a pending key in "later" whose lease runs has a live owner: a dead
	-- one's key was reset above)
	IF pg_catalog.cardinality(later) OPERATOR(pg_catalog.>) 0 THEN
		UPDATE idempotency.keys k
		   SET sweep_at = CASE WHEN k.status OPERATOR(pg_catalog.=) 'pending' AND k.token IS NOT NULL
								AND k.lease_until OPERATOR(pg_catalog.>) now
							   THEN k.lease_until
							   WHEN idempotency._remembered(k.status, k.expires_at, k.remember, now)
							   THEN k.expires_at OPERATOR(pg_catalog.+) k.remember
							   ELSE k.expires_at END
		 WHERE k.ctid OPERATOR(pg_catalog.=) ANY (later);
		GET DIAGNOSTICS rescheduled = ROW_COUNT;
	END IF;
END;
$$;

/*
 * Delete keys past their retention (compact the remembered ones) and reset
 * pending keys whose lease ended (or whose session ended), at most
 * batch_size of each kind; keys found before their time are rescheduled on
 * the way.  Never waits: rows
 * that others are changing or locking are skipped (FOR NO KEY UPDATE SKIP
 * LOCKED, which also reads the newest committed version of each).  Sends
 * NOTIFY idempotency_abandoned once for each scope where it reset a key,
 * delivered when the caller's transaction commits.
 */
CREATE OR REPLACE FUNCTION idempotency.idem_sweep(
	batch_size	integer	DEFAULT NULL)
RETURNS TABLE (expired bigint, reset bigint)
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE ROWS 1 SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	batch bigint;
	now timestamptz;
	verdict integer;
	tids tid[];
	w record;
	n bigint;
	owners bigint[];
	dead bigint[];
BEGIN
	IF batch_size IS NOT NULL AND batch_size OPERATOR(pg_catalog.<=) 0 THEN
		RAISE EXCEPTION 'batch_size must be positive' USING ERRCODE = '22023';
	END IF;
	batch := COALESCE(batch_size,
		idempotency._guc_bytes('idempotency.sweep_batch', 1000)::integer);
	PERFORM idempotency._check_writable('idem_sweep()');
	-- row exclusive on the table first, so that the verdict below is the
	-- table's as it is (see idem_claim)
	IF pg_catalog.to_regclass('idempotency.keys') IS NOT NULL THEN
		LOCK TABLE idempotency.keys IN ROW EXCLUSIVE MODE;
	END IF;
	-- the store's verdict, cached in this query's plan (see _store_verdict)
	SELECT v.verdict INTO verdict
	  FROM (SELECT idempotency._store_verdict() AS verdict,
				   'idempotency.token_seq'::pg_catalog.regclass AS seq) v
	  LEFT JOIN idempotency.keys k ON false;
	now := pg_catalog.clock_timestamp();
	expired := 0;
	reset := 0;
	LOOP
		n := LEAST(batch OPERATOR(pg_catalog.*) 2, 2147483647);
		tids := ARRAY(SELECT k.ctid FROM idempotency.keys k
					   WHERE k.sweep_at OPERATOR(pg_catalog.<=) now
					   ORDER BY k.sweep_at
					   LIMIT n
					   FOR NO KEY UPDATE SKIP LOCKED);
		w := idempotency._sweep_rows(tids, now, batch OPERATOR(pg_catalog.-) expired,
			batch OPERATOR(pg_catalog.-) reset, true, verdict);
		expired := expired OPERATOR(pg_catalog.+) w.expired;
		reset := reset OPERATOR(pg_catalog.+) w.reset;
		EXIT WHEN pg_catalog.cardinality(tids) OPERATOR(pg_catalog.<) n
			OR w.expired OPERATOR(pg_catalog.+) w.reset OPERATOR(pg_catalog.+) w.rescheduled OPERATOR(pg_catalog.=) 0
			OR expired OPERATOR(pg_catalog.>=) batch OR reset OPERATOR(pg_catalog.>=) batch;
	END LOOP;
	-- the keys of sessions that ended: found through keys_owner_session_idx
	IF expired OPERATOR(pg_catalog.<) batch AND reset OPERATOR(pg_catalog.<) batch THEN
		owners := ARRAY(SELECT DISTINCT k.owner_session FROM idempotency.keys k
						 WHERE k.owner_session IS NOT NULL);
		dead := ARRAY(SELECT o FROM pg_catalog.unnest(owners) o
					   WHERE NOT idempotency._session_alive(o));
		IF pg_catalog.cardinality(dead) OPERATOR(pg_catalog.>) 0 THEN
			tids := ARRAY(SELECT k.ctid FROM idempotency.keys k
						   WHERE k.owner_session OPERATOR(pg_catalog.=) ANY (dead)
						   FOR NO KEY UPDATE SKIP LOCKED);
			w := idempotency._sweep_rows(tids, now, batch OPERATOR(pg_catalog.-) expired,
				batch OPERATOR(pg_catalog.-) reset, false, verdict);
			expired := expired OPERATOR(pg_catalog.+) w.expired;
			reset := reset OPERATOR(pg_catalog.+) w.reset;
		END IF;
	END IF;
	RETURN NEXT;
END;
$$;

REVOKE ALL ON FUNCTION idempotency.idem_sweep(integer) FROM PUBLIC;
