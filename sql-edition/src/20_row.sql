/*-------------------------------------------------------------------------
 *
 * 20_row.sql
 *	  Reading one key at its newest committed state.
 *
 * Mirrors row.c: _probe reads a key without waiting or locking, and tells
 * from the row version's xmin and xmax (_xid8, _multi_busy) whether this
 * transaction wrote it or another one is changing it right now, which the
 * C edition learns from a dirty snapshot that SQL does not have;
 * _check_row refuses a stored row the functions never write (XX001);
 * _remembered says whether a finished key past its retention is
 * remembered.  Never writes.  The row-lock questions a token call asks (_row_hold) are
 * in 35_holder.sql, its only caller.
 *
 *-------------------------------------------------------------------------
 */

/* ---------------------------------------------------------------------
 * Reading a key (row.c)
 * ---------------------------------------------------------------------
 */

/* The xid8 of a 32-bit xid seen by the snapshot "snap"; NULL for none. */
CREATE OR REPLACE FUNCTION idempotency._xid8(x xid, snap pg_snapshot)
RETURNS xid8
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	x32 bigint := x::text::bigint;
	nxt bigint := pg_catalog.pg_snapshot_xmax(snap)::text::bigint;
	d bigint;
BEGIN
	IF x32 OPERATOR(pg_catalog.<) 3 THEN
		RETURN NULL;			-- invalid, bootstrap or frozen
	END IF;
	-- the distance from the snapshot's horizon, modulo 2^32, as a signed
	-- number: our own xids may lie just beyond it
	d := ((x32 OPERATOR(pg_catalog.-) (nxt OPERATOR(pg_catalog.&) 4294967295)
		   OPERATOR(pg_catalog.+) 2147483648) OPERATOR(pg_catalog.&) 4294967295)
		 OPERATOR(pg_catalog.-) 2147483648;
	IF nxt OPERATOR(pg_catalog.+) d OPERATOR(pg_catalog.<) 3 THEN
		RETURN NULL;
	END IF;
	RETURN (nxt OPERATOR(pg_catalog.+) d)::text::xid8;
END;
$$;

/*
 * Refuse (XX001) a stored row that the functions never write: a NULL in a
 * NOT NULL column, an unknown status, a fingerprint that is no SHA-256.
 */
CREATE OR REPLACE FUNCTION idempotency._check_row(p_scope text, p_key text,
	status text, attempt integer, created_at timestamptz, expires_at timestamptz,
	retention interval, sweep_at timestamptz, fingerprint bytea)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	IF status IS NULL OR attempt IS NULL OR created_at IS NULL OR
	   expires_at IS NULL OR retention IS NULL OR sweep_at IS NULL THEN
		RAISE EXCEPTION 'idempotency key % has no value in column "%"',
			idempotency._key_display(p_scope, p_key),
			CASE WHEN status IS NULL THEN 'status' WHEN attempt IS NULL THEN 'attempt'
				 WHEN created_at IS NULL THEN 'created_at' WHEN expires_at IS NULL THEN 'expires_at'
				 WHEN retention IS NULL THEN 'retention' ELSE 'sweep_at' END
			USING ERRCODE = 'XX001',
				  HINT = 'Someone changed idempotency.keys outside the extension''s functions.';
	END IF;
	IF status OPERATOR(pg_catalog.<>) ALL (ARRAY['pending', 'succeeded', 'failed']) THEN
		RAISE EXCEPTION 'idempotency key has an unknown status "%"', status
			USING ERRCODE = 'XX001',
				  HINT = 'Someone changed idempotency.keys outside the extension''s functions.';
	END IF;
	IF fingerprint IS NOT NULL AND pg_catalog.octet_length(fingerprint) OPERATOR(pg_catalog.<>) 32 THEN
		RAISE EXCEPTION 'idempotency key has a fingerprint of % bytes, expected 32',
			pg_catalog.octet_length(fingerprint)
			USING ERRCODE = 'XX001',
				  HINT = 'Someone changed idempotency.keys outside the extension''s functions.';
	END IF;
END;
$$;

/*
 * Is a key remembered at "now": finished, past its retention and not past
 * its remember?  Such a key never runs again: a claim answers expired (or
 * mismatch), whether or not a sweep has compacted it yet.  False, never
 * NULL, for a key without remember.  An inlined SQL function.
 */
CREATE OR REPLACE FUNCTION idempotency._remembered(status text, expires_at timestamptz,
	remember interval, now timestamptz)
RETURNS boolean
LANGUAGE sql STABLE
RETURN remember IS NOT NULL AND status OPERATOR(pg_catalog.<>) 'pending'
	AND expires_at OPERATOR(pg_catalog.<=) now
	AND expires_at OPERATOR(pg_catalog.+) remember OPERATOR(pg_catalog.>) now;

/*
 * Is the row version whose xmax is "x" changed or row-locked right now by
 * another transaction through a multixact?  A row that several
 * transactions lock, or that one transaction locks and then updates in a
 * subtransaction (a fresh claim inserts inside an exception block), carries
 * a multixact id in xmax, which SQL cannot tell from a transaction id: so
 * "x" is read as a multixact too.  It counts as busy when one of its
 * members is still running and is not ours, while another backend holds a
 * lock on idempotency.keys (every transaction that locks or changes a row
 * of the table does until it ends: that keeps a transaction id that is
 * also the number of some other table's multixact from counting, unless
 * the table is in use right then).  A member is taken for ours when it is
 * our transaction's id or newer than it (our subtransactions' ids are; a
 * transaction that began after ours and locks the row is then missed, and
 * the write that follows waits for it).  An "x" that is no multixact (too
 * old, or not created yet) is not busy.
 */
CREATE OR REPLACE FUNCTION idempotency._multi_busy(x xid, snap pg_snapshot)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	m record;
	x8 xid8;
	top xid8 := pg_catalog.pg_current_xact_id_if_assigned();
BEGIN
	FOR m IN SELECT mm.xid FROM pg_catalog.pg_get_multixact_members(x) mm LOOP
		x8 := idempotency._xid8(m.xid, snap);
		CONTINUE WHEN x8 IS NULL OR
			pg_catalog.pg_xact_status(x8) IS DISTINCT FROM 'in progress' OR
			x8 OPERATOR(pg_catalog.>=) top;
		RETURN EXISTS (SELECT FROM pg_catalog.pg_locks r
						WHERE r.locktype OPERATOR(pg_catalog.=) 'relation'
						  AND r.relation OPERATOR(pg_catalog.=) 'idempotency.keys'::pg_catalog.regclass
						  AND r.granted
						  AND r.pid OPERATOR(pg_catalog.<>) pg_catalog.pg_backend_pid());
	END LOOP;
	RETURN false;
EXCEPTION WHEN OTHERS THEN
	RETURN false;				-- no such multixact: a plain transaction id
END;
$$;

-- versions before 1.7.0 returned no remember (01_update.sql)
DO $do$
BEGIN
	PERFORM idempotency._update_set_aside('idempotency._probe(text,text)', 'remember');
END;
$do$;

/*
 * Read one key at its newest committed state, as a claim must judge it,
 * without waiting and without locking anything.  The SQL edition has no
 * dirty snapshot, so it reads the row version its statement sees and asks
 * the version's xmin and xmax:
 *   - xmin still running: our own transaction wrote it ("mine": another
 *     transaction's uncommitted version is never visible);
 *   - xmax running and not ours: another transaction is changing, deleting
 *     or row-locking it right now ("busy");
 *   - xmax committed after the statement's snapshot: a newer version was
 *     committed meanwhile; read again (READ COMMITTED), or, where the
 *     transaction's snapshot may not move (REPEATABLE READ, SERIALIZABLE),
 *     raise a serialization failure.
 * That last test is not complete: a snapshot lists running top-level
 * transactions only, so a change made in a subtransaction (every writer
 * may write inside an exception block) or through a multixact, committed
 * between the statement's snapshot and the questions, looks as if it
 * committed before.  The version read is then the one the snapshot saw,
 * which answers consistently as of that moment, but the version to write
 * has been replaced: every write by tid that finds no row reads the key
 * again.
 * A key another transaction is inserting is invisible here; its claim's
 * insert finds it (the unique check) and answers in_progress.
 */
CREATE OR REPLACE FUNCTION idempotency._probe(p_scope text, p_key text,
	OUT present boolean, OUT busy boolean, OUT mine boolean, OUT tid tid,
	OUT status text, OUT token bigint, OUT attempt integer, OUT fingerprint bytea,
	OUT response_code integer, OUT response_body jsonb,
	OUT created_at timestamptz, OUT finished_at timestamptz,
	OUT lease_until timestamptz, OUT expires_at timestamptz,
	OUT retention interval, OUT sweep_at timestamptz, OUT phase text,
	OUT phase_data jsonb, OUT owner_session bigint, OUT remember interval)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	rec record;
	x8 xid8;
	st text;
BEGIN
	busy := false;
	mine := false;
	FOR round IN 1..10 LOOP
		SELECT k.*, k.ctid AS tid_, k.xmin AS xmin_, k.xmax AS xmax_,
			   pg_catalog.pg_current_snapshot() AS snap_
		  INTO rec
		  FROM idempotency.keys k
		 WHERE k.scope OPERATOR(pg_catalog.=) p_scope
		   AND k.key OPERATOR(pg_catalog.=) p_key;
		present := FOUND;
		IF NOT present THEN
			RETURN;
		END IF;
		tid := rec.tid_; status := rec.status; token := rec.token;
		attempt := rec.attempt; fingerprint := rec.fingerprint;
		response_code := rec.response_code; response_body := rec.response_body;
		created_at := rec.created_at; finished_at := rec.finished_at;
		lease_until := rec.lease_until; expires_at := rec.expires_at;
		retention := rec.retention; sweep_at := rec.sweep_at;
		phase := rec.phase; phase_data := rec.phase_data;
		owner_session := rec.owner_session; remember := rec.remember;
		PERFORM idempotency._check_row(p_scope, p_key, status, attempt, created_at,
			expires_at, retention, sweep_at, fingerprint);
		x8 := idempotency._xid8(rec.xmin_, rec.snap_);
		mine := x8 IS NOT NULL AND
			pg_catalog.pg_xact_status(x8) OPERATOR(pg_catalog.=) 'in progress';
		IF rec.xmax_ OPERATOR(pg_catalog.=) '0'::xid THEN
			RETURN;				-- never changed, deleted or locked
		END IF;
		x8 := idempotency._xid8(rec.xmax_, rec.snap_);
		IF x8 IS NULL THEN
			busy := idempotency._multi_busy(rec.xmax_, rec.snap_);
			RETURN;
		END IF;
		st := pg_catalog.pg_xact_status(x8);
		IF st OPERATOR(pg_catalog.=) 'in progress' THEN
			-- running: another transaction's change or row lock, unless it is
			-- ours (a transaction holds the lock on each of its xids)
			busy := x8 IS DISTINCT FROM pg_catalog.pg_current_xact_id_if_assigned() AND
				NOT EXISTS (SELECT FROM pg_catalog.pg_locks l
							 WHERE l.locktype OPERATOR(pg_catalog.=) 'transactionid'
							   AND l.transactionid OPERATOR(pg_catalog.=) rec.xmax_
							   AND l.pid OPERATOR(pg_catalog.=) pg_catalog.pg_backend_pid());
			RETURN;
		END IF;
		IF idempotency._multi_busy(rec.xmax_, rec.snap_) THEN
			busy := true;
			RETURN;
		END IF;
		IF st IS DISTINCT FROM 'committed' OR
		   pg_catalog.pg_visible_in_snapshot(x8, rec.snap_) THEN
			RETURN;				-- aborted, or a row lock that has ended
		END IF;
		IF pg_catalog.current_setting('transaction_isolation') OPERATOR(pg_catalog.<>) 'read committed' THEN
			RAISE EXCEPTION 'could not serialize access due to concurrent update of an idempotency key'
				USING ERRCODE = '40001', HINT = 'Retry the transaction.';
		END IF;
	END LOOP;
	busy := true;
END;
$$;
