/*
 * bench/plpgsql_peer.sql: the extension's contract written in PL/pgSQL, as a
 * careful user would write it instead of installing the extension.  It is
 * row 6 (and the peer of rows 9 and 10) of the benchmark, so it is written
 * to be both correct and fast:
 *
 *  - same table shape as idempotency.keys (PK + sweep_at index), same token
 *    sequence, same outcomes, same SQLSTATEs (bench/plpgsql_peer_check.sql
 *    runs the same checks against both);
 *  - replay, mismatch and in_progress answers come from one plain SELECT
 *    (MVCC: only committed data, or the caller's own), with no lock and no
 *    subtransaction;
 *  - writes never wait on another transaction: PL/pgSQL has no dirty read,
 *    so INSERT ... ON CONFLICT (which waits for an uncommitted conflicting
 *    insert) runs under lock_timeout = 1ms, the smallest value PostgreSQL
 *    accepts, and the lock_not_available it raises is caught and answered as
 *    in_progress (after three tries: the 1 ms timeout also fires on short
 *    waits of other kinds, such as a relation extension lock under
 *    concurrent inserts).  Catching needs an EXCEPTION block, that is one
 *    subtransaction (and one extra XID) per claim that writes: the price of
 *    doing this in PL/pgSQL.  A batch of 10,000 claims in one transaction
 *    works, but overflows the backend's subtransaction cache.
 *    Advisory locks are not used: a transaction-level one per key would be
 *    held until commit (a 10,000-key batch would fill the lock table), and a
 *    session-level one released at the end of the function protects nothing
 *    once the claiming row is uncommitted.
 *  - finish / extend / release lock the row with SELECT ... FOR UPDATE
 *    NOWAIT (a row another transaction is changing raises 55P03 at once,
 *    never a wait), check status and token, then UPDATE or DELETE it.  An
 *    UPDATE-first design under lock_timeout was tried: the 1 ms timeout also
 *    fires on relation extension locks under concurrent writes and raised
 *    spurious 55P03 errors.
 *  - SECURITY DEFINER with a pinned search_path, as the table is not
 *    granted to application roles.
 *
 * Settings (optional): idem_plpgsql.lease (default 30s),
 * idem_plpgsql.retention (default 1 day), idem_plpgsql.sweep_batch (1000).
 */

CREATE SCHEMA idem_plpgsql;

CREATE SEQUENCE idem_plpgsql.token_seq AS bigint NO CYCLE;

CREATE TABLE idem_plpgsql.keys (
	scope			text COLLATE "C" NOT NULL,
	key				text COLLATE "C" NOT NULL,
	status			text COLLATE "C" NOT NULL
		CHECK (status IN ('pending', 'succeeded', 'failed')),
	token			bigint,
	attempt			integer NOT NULL,
	fingerprint		bytea,
	response_code	integer,
	response_body	jsonb,
	created_at		timestamptz NOT NULL,
	finished_at		timestamptz,
	lease_until		timestamptz,
	expires_at		timestamptz NOT NULL,
	retention		interval NOT NULL,
	sweep_at		timestamptz NOT NULL,
	CONSTRAINT keys_pkey PRIMARY KEY (scope, key)
);
CREATE INDEX keys_sweep_at_idx ON idem_plpgsql.keys (sweep_at);
REVOKE ALL ON TABLE idem_plpgsql.keys FROM PUBLIC;
REVOKE ALL ON SEQUENCE idem_plpgsql.token_seq FROM PUBLIC;

/*
 * Is this visible row version written by the caller's own open transaction?
 * A visible version whose xmin is still in progress can only be ours.  Used
 * only on the wait path (a claim of a key the caller itself holds must
 * answer in_progress at once instead of waiting for itself).
 */
CREATE FUNCTION idem_plpgsql._is_own(p_xmin xid)
RETURNS boolean LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	v_top	bigint := pg_current_xact_id_if_assigned()::text::bigint;
	v_x		bigint;
BEGIN
	IF v_top IS NULL THEN
		RETURN false;				-- we have written nothing
	END IF;
	v_x := (v_top & ~x'FFFFFFFF'::bigint) | p_xmin::text::bigint;
	IF v_x < v_top - 2147483648 THEN
		v_x := v_x + 4294967296;
	ELSIF v_x > v_top + 2147483648 THEN
		v_x := v_x - 4294967296;
	END IF;
	RETURN pg_xact_status(v_x::text::xid8) = 'in progress';
EXCEPTION WHEN OTHERS THEN
	RETURN false;					-- frozen or truncated xid: not ours
END;
$$;

CREATE FUNCTION idem_plpgsql.idem_claim(
	key			text,
	request		jsonb		DEFAULT NULL,
	scope		text		DEFAULT '',
	lease		interval	DEFAULT NULL,
	retention	interval	DEFAULT NULL,
	wait		interval	DEFAULT '0',
	OUT outcome			text,
	OUT token			bigint,
	OUT attempt			integer,
	OUT status			text,
	OUT response_code	integer,
	OUT response_body	jsonb,
	OUT retry_after		integer)
RETURNS record
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '1ms'
AS $$
DECLARE
	v_key		text := idem_claim.key;
	v_scope		text := idem_claim.scope;
	v_lease		interval;
	v_ret		interval;
	v_fp		bytea;
	v_now		timestamptz;
	v_deadline	timestamptz;
	r			record;
	v_mode		text;
	v_loops		integer := 0;
BEGIN
	IF v_key IS NULL OR v_scope IS NULL THEN
		RAISE EXCEPTION 'key and scope must not be NULL' USING ERRCODE = 'null_value_not_allowed';
	END IF;
	IF v_key = '' THEN
		RAISE EXCEPTION 'key must not be empty' USING ERRCODE = 'invalid_parameter_value';
	END IF;
	IF length(v_key) > 255 OR length(v_scope) > 255 THEN
		RAISE EXCEPTION 'key and scope must not be longer than 255 characters'
			USING ERRCODE = 'string_data_right_truncation';
	END IF;
	IF idem_claim.wait IS NULL THEN
		RAISE EXCEPTION 'wait must not be NULL' USING ERRCODE = 'null_value_not_allowed';
	END IF;
	IF idem_claim.wait < interval '0' THEN
		RAISE EXCEPTION 'wait must not be negative' USING ERRCODE = 'invalid_parameter_value';
	END IF;
	v_lease := coalesce(idem_claim.lease,
						nullif(current_setting('idem_plpgsql.lease', true), '')::interval,
						interval '30 seconds');
	v_ret := coalesce(idem_claim.retention,
					  nullif(current_setting('idem_plpgsql.retention', true), '')::interval,
					  interval '1 day');
	IF v_lease <= interval '0' THEN
		RAISE EXCEPTION 'lease must be positive' USING ERRCODE = 'invalid_parameter_value';
	END IF;
	IF v_ret <= interval '0' THEN
		RAISE EXCEPTION 'retention must be positive' USING ERRCODE = 'invalid_parameter_value';
	END IF;
	IF pg_is_in_recovery() THEN
		RAISE EXCEPTION 'cannot change idempotency keys during recovery'
			USING ERRCODE = 'read_only_sql_transaction';
	END IF;

	IF idem_claim.request IS NOT NULL THEN
		v_fp := sha256(convert_to(idem_claim.request::text, 'UTF8'));
	END IF;
	IF idem_claim.wait > interval '0' THEN
		v_deadline := clock_timestamp() + idem_claim.wait;
	END IF;

	LOOP
		v_loops := v_loops + 1;
		v_now := clock_timestamp();
		v_mode := NULL;

		/* Lock-free read: committed state, or our own transaction's. */
		SELECT k.status, k.token, k.attempt, k.fingerprint, k.response_code,
			   k.response_body, k.lease_until, k.expires_at, k.xmin AS xmin
		  INTO r
		  FROM idem_plpgsql.keys k
		 WHERE k.scope = v_scope AND k.key = v_key;

		IF NOT FOUND THEN
			v_mode := 'insert';
		ELSIF r.expires_at <= v_now THEN
			v_mode := 'replace';		-- past retention: as if absent
		ELSIF r.fingerprint IS DISTINCT FROM v_fp THEN
			outcome := 'mismatch';
			RETURN;
		ELSIF r.status <> 'pending' THEN
			outcome := 'replay';
			status := r.status;
			response_code := r.response_code;
			response_body := r.response_body;
			RETURN;
		ELSIF r.token IS NULL OR r.lease_until <= v_now THEN
			v_mode := 'takeover';
		ELSE
			/* a live claim */
			IF v_deadline IS NULL OR clock_timestamp() >= v_deadline
			   OR idem_plpgsql._is_own(r.xmin) THEN
				outcome := 'in_progress';
				retry_after := greatest(1, ceil(extract(epoch FROM r.lease_until - v_now)))::integer;
				RETURN;
			END IF;
		END IF;

		IF v_mode IS NOT NULL THEN
			BEGIN
				IF v_mode = 'insert' THEN
					INSERT INTO idem_plpgsql.keys AS k
						(scope, key, status, token, attempt, fingerprint,
						 created_at, lease_until, expires_at, retention, sweep_at)
					VALUES (v_scope, v_key, 'pending',
							nextval('idem_plpgsql.token_seq'), 1, v_fp,
							v_now, v_now + v_lease,
							greatest(v_now + v_ret, v_now + v_lease), v_ret,
							v_now + v_lease)
					ON CONFLICT ON CONSTRAINT keys_pkey DO NOTHING
					RETURNING k.token, k.attempt INTO token, attempt;
				ELSIF v_mode = 'takeover' THEN
					UPDATE idem_plpgsql.keys AS k
					   SET token = nextval('idem_plpgsql.token_seq'),
						   attempt = k.attempt + 1,
						   lease_until = v_now + v_lease,
						   expires_at = greatest(v_now + v_ret, v_now + v_lease),
						   retention = v_ret,
						   sweep_at = v_now + v_lease
					 WHERE k.scope = v_scope AND k.key = v_key
					   AND k.status = 'pending'
					   AND (k.token IS NULL OR k.lease_until <= v_now)
					   AND k.expires_at > v_now
					   AND k.fingerprint IS NOT DISTINCT FROM v_fp
					RETURNING k.token, k.attempt INTO token, attempt;
				ELSE	-- replace a key past its retention
					UPDATE idem_plpgsql.keys AS k
					   SET status = 'pending',
						   token = nextval('idem_plpgsql.token_seq'),
						   attempt = 1,
						   fingerprint = v_fp,
						   response_code = NULL,
						   response_body = NULL,
						   created_at = v_now,
						   finished_at = NULL,
						   lease_until = v_now + v_lease,
						   expires_at = greatest(v_now + v_ret, v_now + v_lease),
						   retention = v_ret,
						   sweep_at = v_now + v_lease
					 WHERE k.scope = v_scope AND k.key = v_key
					   AND k.expires_at <= v_now
					RETURNING k.token, k.attempt INTO token, attempt;
				END IF;
				IF FOUND THEN
					outcome := 'claimed';
					RETURN;
				END IF;
				/* lost a race with a committed change: read again */
			EXCEPTION WHEN lock_not_available THEN
				/*
				 * Another transaction is writing this key right now, or the
				 * 1 ms lock_timeout caught a short wait of another kind (a
				 * relation extension lock under concurrent inserts): look
				 * again, up to three times, before answering in_progress.
				 */
				IF (v_deadline IS NULL AND v_loops >= 3)
				   OR clock_timestamp() >= v_deadline THEN
					outcome := 'in_progress';
					retry_after := 1;
					RETURN;
				END IF;
			END;
			IF v_deadline IS NULL AND v_loops >= 3 THEN
				outcome := 'in_progress';
				retry_after := 1;
				RETURN;
			END IF;
		END IF;

		IF v_deadline IS NOT NULL AND v_mode IS DISTINCT FROM 'insert' THEN
			PERFORM pg_sleep(0.01);		-- poll, as the extension does without preload
		END IF;
	END LOOP;
END;
$$;

CREATE FUNCTION idem_plpgsql.idem_finish(
	key				text,
	token			bigint,
	response_code	integer		DEFAULT NULL,
	response_body	jsonb		DEFAULT NULL,
	scope			text		DEFAULT '',
	status			text		DEFAULT 'succeeded',
	retention		interval	DEFAULT NULL)
RETURNS timestamptz
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	v_key	text := idem_finish.key;
	v_scope	text := idem_finish.scope;
	v_tok	bigint := idem_finish.token;
	v_now	timestamptz;
	v_exp	timestamptz;
	r		record;
BEGIN
	IF v_key IS NULL OR v_scope IS NULL THEN
		RAISE EXCEPTION 'key and scope must not be NULL' USING ERRCODE = 'null_value_not_allowed';
	END IF;
	IF v_key = '' THEN
		RAISE EXCEPTION 'key must not be empty' USING ERRCODE = 'invalid_parameter_value';
	END IF;
	IF length(v_key) > 255 OR length(v_scope) > 255 THEN
		RAISE EXCEPTION 'key and scope must not be longer than 255 characters'
			USING ERRCODE = 'string_data_right_truncation';
	END IF;
	IF v_tok IS NULL THEN
		RAISE EXCEPTION 'token must not be NULL' USING ERRCODE = 'null_value_not_allowed';
	END IF;
	IF idem_finish.status IS NULL THEN
		RAISE EXCEPTION 'status must not be NULL' USING ERRCODE = 'null_value_not_allowed';
	END IF;
	IF idem_finish.status NOT IN ('succeeded', 'failed') THEN
		RAISE EXCEPTION 'status must be ''succeeded'' or ''failed'', not "%"', idem_finish.status
			USING ERRCODE = 'invalid_parameter_value';
	END IF;
	IF idem_finish.retention <= interval '0' THEN
		RAISE EXCEPTION 'retention must be positive' USING ERRCODE = 'invalid_parameter_value';
	END IF;
	IF pg_column_size(idem_finish.response_body) > 1048576 THEN
		RAISE EXCEPTION 'response_body is larger than 1MB' USING ERRCODE = 'program_limit_exceeded';
	END IF;
	IF pg_is_in_recovery() THEN
		RAISE EXCEPTION 'cannot change idempotency keys during recovery'
			USING ERRCODE = 'read_only_sql_transaction';
	END IF;

	/* NOWAIT: a row another transaction is changing raises 55P03 at once */
	v_now := clock_timestamp();
	SELECT k.status, k.token, k.expires_at INTO r
	  FROM idem_plpgsql.keys k WHERE k.scope = v_scope AND k.key = v_key
	   FOR UPDATE NOWAIT;
	IF NOT FOUND OR r.expires_at <= v_now THEN
		RAISE EXCEPTION 'idempotency key "%" does not exist', v_key
			USING ERRCODE = 'no_data_found';
	ELSIF r.status <> 'pending' THEN
		IF r.token = v_tok THEN
			RETURN r.expires_at;		-- repeated finish: same answer
		END IF;
		RAISE EXCEPTION 'idempotency key "%" was finished by another attempt', v_key
			USING ERRCODE = 'object_not_in_prerequisite_state';
	ELSIF r.token IS DISTINCT FROM v_tok THEN
		RAISE EXCEPTION 'token % is not the current token of idempotency key "%"', v_tok, v_key
			USING ERRCODE = 'object_in_use';
	END IF;
	UPDATE idem_plpgsql.keys AS k
	   SET status = idem_finish.status,
		   response_code = idem_finish.response_code,
		   response_body = idem_finish.response_body,
		   finished_at = v_now,
		   lease_until = NULL,
		   expires_at = v_now + coalesce(idem_finish.retention, k.retention),
		   sweep_at = v_now + coalesce(idem_finish.retention, k.retention)
	 WHERE k.scope = v_scope AND k.key = v_key
	RETURNING k.expires_at INTO v_exp;
	RETURN v_exp;
END;
$$;

CREATE FUNCTION idem_plpgsql.idem_extend(
	key		text,
	token	bigint,
	lease	interval	DEFAULT NULL,
	scope	text		DEFAULT '')
RETURNS timestamptz
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	v_key	text := idem_extend.key;
	v_scope	text := idem_extend.scope;
	v_tok	bigint := idem_extend.token;
	v_lease	interval;
	v_now	timestamptz;
	v_until	timestamptz;
	r		record;
BEGIN
	IF v_key IS NULL OR v_scope IS NULL THEN
		RAISE EXCEPTION 'key and scope must not be NULL' USING ERRCODE = 'null_value_not_allowed';
	END IF;
	IF v_key = '' THEN
		RAISE EXCEPTION 'key must not be empty' USING ERRCODE = 'invalid_parameter_value';
	END IF;
	IF length(v_key) > 255 OR length(v_scope) > 255 THEN
		RAISE EXCEPTION 'key and scope must not be longer than 255 characters'
			USING ERRCODE = 'string_data_right_truncation';
	END IF;
	IF v_tok IS NULL THEN
		RAISE EXCEPTION 'token must not be NULL' USING ERRCODE = 'null_value_not_allowed';
	END IF;
	v_lease := coalesce(idem_extend.lease,
						nullif(current_setting('idem_plpgsql.lease', true), '')::interval,
						interval '30 seconds');
	IF v_lease <= interval '0' THEN
		RAISE EXCEPTION 'lease must be positive' USING ERRCODE = 'invalid_parameter_value';
	END IF;
	IF pg_is_in_recovery() THEN
		RAISE EXCEPTION 'cannot change idempotency keys during recovery'
			USING ERRCODE = 'read_only_sql_transaction';
	END IF;

	v_now := clock_timestamp();
	SELECT k.status, k.token, k.expires_at INTO r
	  FROM idem_plpgsql.keys k WHERE k.scope = v_scope AND k.key = v_key
	   FOR UPDATE NOWAIT;
	IF NOT FOUND OR r.expires_at <= v_now THEN
		RAISE EXCEPTION 'idempotency key "%" does not exist', v_key
			USING ERRCODE = 'no_data_found';
	ELSIF r.status <> 'pending' THEN
		RAISE EXCEPTION 'idempotency key "%" is already finished', v_key
			USING ERRCODE = 'object_not_in_prerequisite_state';
	ELSIF r.token IS DISTINCT FROM v_tok THEN
		RAISE EXCEPTION 'token % is not the current token of idempotency key "%"', v_tok, v_key
			USING ERRCODE = 'object_in_use';
	END IF;
	UPDATE idem_plpgsql.keys AS k
	   SET lease_until = v_now + v_lease,
		   expires_at = greatest(v_now + k.retention, v_now + v_lease),
		   sweep_at = v_now + v_lease
	 WHERE k.scope = v_scope AND k.key = v_key
	RETURNING k.lease_until INTO v_until;
	RETURN v_until;
END;
$$;

CREATE FUNCTION idem_plpgsql.idem_release(
	key		text,
	token	bigint,
	scope	text	DEFAULT '')
RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	v_key	text := idem_release.key;
	v_scope	text := idem_release.scope;
	v_tok	bigint := idem_release.token;
	v_now	timestamptz;
	r		record;
BEGIN
	IF v_key IS NULL OR v_scope IS NULL THEN
		RAISE EXCEPTION 'key and scope must not be NULL' USING ERRCODE = 'null_value_not_allowed';
	END IF;
	IF v_key = '' THEN
		RAISE EXCEPTION 'key must not be empty' USING ERRCODE = 'invalid_parameter_value';
	END IF;
	IF length(v_key) > 255 OR length(v_scope) > 255 THEN
		RAISE EXCEPTION 'key and scope must not be longer than 255 characters'
			USING ERRCODE = 'string_data_right_truncation';
	END IF;
	IF v_tok IS NULL THEN
		RAISE EXCEPTION 'token must not be NULL' USING ERRCODE = 'null_value_not_allowed';
	END IF;
	IF pg_is_in_recovery() THEN
		RAISE EXCEPTION 'cannot change idempotency keys during recovery'
			USING ERRCODE = 'read_only_sql_transaction';
	END IF;

	v_now := clock_timestamp();
	SELECT k.status, k.token, k.expires_at INTO r
	  FROM idem_plpgsql.keys k WHERE k.scope = v_scope AND k.key = v_key
	   FOR UPDATE NOWAIT;
	IF NOT FOUND OR r.expires_at <= v_now THEN
		RAISE EXCEPTION 'idempotency key "%" does not exist', v_key
			USING ERRCODE = 'no_data_found';
	ELSIF r.status <> 'pending' THEN
		RAISE EXCEPTION 'idempotency key "%" is already finished', v_key
			USING ERRCODE = 'object_not_in_prerequisite_state';
	ELSIF r.token IS DISTINCT FROM v_tok THEN
		RAISE EXCEPTION 'token % is not the current token of idempotency key "%"', v_tok, v_key
			USING ERRCODE = 'object_in_use';
	END IF;
	DELETE FROM idem_plpgsql.keys AS k WHERE k.scope = v_scope AND k.key = v_key;
END;
$$;

CREATE FUNCTION idem_plpgsql.idem_lookup(
	key		text,
	scope	text	DEFAULT '')
RETURNS TABLE (status text, attempt integer, response_code integer,
			   response_body jsonb, created_at timestamptz,
			   finished_at timestamptz, expires_at timestamptz)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	IF idem_lookup.key IS NULL OR idem_lookup.scope IS NULL THEN
		RAISE EXCEPTION 'key and scope must not be NULL' USING ERRCODE = 'null_value_not_allowed';
	END IF;
	IF idem_lookup.key = '' THEN
		RAISE EXCEPTION 'key must not be empty' USING ERRCODE = 'invalid_parameter_value';
	END IF;
	IF length(idem_lookup.key) > 255 OR length(idem_lookup.scope) > 255 THEN
		RAISE EXCEPTION 'key and scope must not be longer than 255 characters'
			USING ERRCODE = 'string_data_right_truncation';
	END IF;
	RETURN QUERY
		SELECT k.status, k.attempt, k.response_code, k.response_body,
			   k.created_at, k.finished_at, k.expires_at
		  FROM idem_plpgsql.keys k
		 WHERE k.scope = idem_lookup.scope AND k.key = idem_lookup.key
		   AND k.expires_at > clock_timestamp();
END;
$$;

CREATE FUNCTION idem_plpgsql.idem_sweep(
	batch_size	integer	DEFAULT NULL,
	OUT expired	bigint,
	OUT reset	bigint)
RETURNS record
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	v_batch	integer := coalesce(idem_sweep.batch_size,
								nullif(current_setting('idem_plpgsql.sweep_batch', true), '')::integer,
								1000);
	v_now	timestamptz := clock_timestamp();
BEGIN
	IF v_batch <= 0 THEN
		RAISE EXCEPTION 'batch_size must be positive' USING ERRCODE = 'invalid_parameter_value';
	END IF;
	IF pg_is_in_recovery() THEN
		RAISE EXCEPTION 'cannot change idempotency keys during recovery'
			USING ERRCODE = 'read_only_sql_transaction';
	END IF;

	DELETE FROM idem_plpgsql.keys AS k
	 WHERE k.ctid = ANY (ARRAY(
			SELECT v.ctid FROM idem_plpgsql.keys v
			 WHERE v.sweep_at <= v_now AND v.expires_at <= v_now
			   AND (v.lease_until IS NULL OR v.lease_until <= v_now)
			 ORDER BY v.sweep_at
			 LIMIT v_batch
			   FOR UPDATE SKIP LOCKED));
	GET DIAGNOSTICS expired = ROW_COUNT;

	UPDATE idem_plpgsql.keys AS k
	   SET token = NULL, sweep_at = k.expires_at
	 WHERE k.ctid = ANY (ARRAY(
			SELECT v.ctid FROM idem_plpgsql.keys v
			 WHERE v.sweep_at <= v_now AND v.status = 'pending'
			   AND v.token IS NOT NULL AND v.lease_until <= v_now
			   AND v.expires_at > v_now
			 ORDER BY v.sweep_at
			 LIMIT v_batch
			   FOR UPDATE SKIP LOCKED));
	GET DIAGNOSTICS reset = ROW_COUNT;
END;
$$;

REVOKE ALL ON FUNCTION idem_plpgsql.idem_sweep(integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION idem_plpgsql._is_own(xid) FROM PUBLIC;
