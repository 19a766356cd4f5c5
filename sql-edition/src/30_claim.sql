/*-------------------------------------------------------------------------
 *
 * 30_claim.sql
 *	  idem_claim and idem_claim_many: the claim decision and its wait.
 *
 * Mirrors claim.c, with the claim's writes of write.c and the wait of
 * wait.c: _write_claim inserts or takes over a key, _held_here knows the
 * claims this transaction holds itself, _flush_tokens makes the token
 * sequence durable before a token leaves the server, and the worker
 * _w_claim decides one claim under the key's advisory lock.  idem_claim
 * and idem_claim_many check their arguments as their caller and call the
 * worker; idem_claim polls while it waits, because nothing can wake a
 * PL/pgSQL function.  Must not touch a key it has not claimed: the calls
 * that present a token are in 35_holder.sql.
 *
 *-------------------------------------------------------------------------
 */

/* ---------------------------------------------------------------------
 * Claims (claim.c, write.c)
 * ---------------------------------------------------------------------
 */

/*
 * Write a claim: insert a new key, or turn the probed row version "old_tid"
 * into a new pending attempt.  A key that another transaction is
 * inserting is invisible here (SQL has no dirty read); the insert's unique
 * check meets it and would wait for that transaction.  Its own lock_timeout
 * makes the check give up after 1 ms instead (the caller answers
 * in_progress): the SQL edition's one wait on another transaction, the
 * shortest PostgreSQL offers.  The timeout covers every lock the write
 * waits for; the caller tells a wait for a row of the key from the others
 * by the error's context.  Marking new keys with advisory locks held to
 * commit would avoid it, but would hold a lock per key until commit.
 */
CREATE OR REPLACE FUNCTION idempotency._write_claim(p_scope text, p_key text,
	old_tid tid, p_token bigint, p_attempt integer, p_fp bytea,
	p_created timestamptz, p_now timestamptz, p_lease_until timestamptz,
	p_expires timestamptz, p_retention interval, p_sweep_at timestamptz,
	p_keep_phase boolean, p_owner bigint)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '1ms'
AS $$
BEGIN
	IF old_tid IS NULL THEN
		INSERT INTO idempotency.keys (scope, key, status, token, attempt,
			fingerprint, response_code, response_body, created_at, finished_at,
			lease_until, expires_at, retention, sweep_at, phase, phase_data,
			owner_session)
		VALUES (p_scope, p_key, 'pending', p_token, 1, p_fp, NULL, NULL,
			p_now, NULL, p_lease_until, p_expires, p_retention, p_lease_until,
			NULL, NULL, p_owner);
		RETURN true;
	END IF;
	IF p_keep_phase THEN
		UPDATE idempotency.keys k
		   SET status = 'pending', token = p_token, attempt = p_attempt,
			   fingerprint = p_fp, response_code = NULL, response_body = NULL,
			   created_at = p_created, finished_at = NULL,
			   lease_until = p_lease_until, expires_at = p_expires,
			   retention = p_retention, sweep_at = p_sweep_at,
			   owner_session = p_owner
		 WHERE k.ctid OPERATOR(pg_catalog.=) old_tid;
	ELSE
		UPDATE idempotency.keys k
		   SET status = 'pending', token = p_token, attempt = p_attempt,
			   fingerprint = p_fp, response_code = NULL, response_body = NULL,
			   created_at = p_created, finished_at = NULL,
			   lease_until = p_lease_until, expires_at = p_expires,
			   retention = p_retention, sweep_at = p_sweep_at,
			   phase = NULL, phase_data = NULL, owner_session = p_owner
		 WHERE k.ctid OPERATOR(pg_catalog.=) old_tid;
	END IF;
	RETURN FOUND;
END;
$$;

/*
 * The first token a claim of this transaction handed out, so that a later
 * claim of the same transaction knows a claim it holds itself (a
 * transaction-local setting: a rollback, also to a savepoint, forgets it).
 */
CREATE OR REPLACE FUNCTION idempotency._held_here(mine boolean, token bigint)
RETURNS boolean
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	first text := pg_catalog.current_setting('idempotency_sql.xact_first_token', true);
BEGIN
	RETURN mine AND token IS NOT NULL AND first IS NOT NULL AND first OPERATOR(pg_catalog.<>) ''
		AND token OPERATOR(pg_catalog.>=) first::bigint;
END;
$$;

/*
 * Make the token sequence's position durable before a token leaves the
 * server: a value handed out under a sequence record that is not flushed
 * yet could be handed out again after a crash.  SQL cannot read the
 * sequence page's LSN as the C edition does, so when any WAL is
 * unflushed it writes a tiny non-transactional WAL message and flushes up
 * to it (PostgreSQL 17's pg_logical_emit_message(..., flush)); before 17
 * the commit's flush is all there is (documented).
 */
CREATE OR REPLACE FUNCTION idempotency._flush_tokens()
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	IF pg_catalog.current_setting('server_version_num')::integer OPERATOR(pg_catalog.>=) 170000
	   AND pg_catalog.pg_current_wal_flush_lsn() OPERATOR(pg_catalog.<) pg_catalog.pg_current_wal_insert_lsn() THEN
		PERFORM pg_catalog.pg_logical_emit_message(false, 'idempotency', '', true);
	END IF;
END;
$$;

/*
 * One claim attempt (claim.c, claim_once): answer from a lock-free probe
 * when possible; else take the key's advisory lock without waiting, probe
 * again, write, and let the lock go at once.  The lock is session-level
 * (a transaction-level one could not be released before commit, and a
 * batch of 10,000 claims would fill the lock table), so an error in
 * between releases it explicitly.  Besides the claim's columns it says
 * whether another transaction is changing the key (busy), whether our own
 * transaction holds the claim (held), and until when the lease it met runs.
 */
CREATE OR REPLACE FUNCTION idempotency._w_claim(caller name, fn text,
	p_key text, p_request jsonb, p_scope text, p_lease interval,
	p_retention interval, p_session_bound boolean, p_flush boolean,
	OUT outcome text, OUT token bigint, OUT attempt integer, OUT status text,
	OUT response_code integer, OUT response_body jsonb, OUT retry_after integer,
	OUT phase text, OUT phase_data jsonb,
	OUT busy boolean, OUT held boolean, OUT lease_until timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	now timestamptz;
	p record;
	h integer;
	action text;
	lease interval;
	retention interval;
	expires timestamptz;
	owner bigint;
	new_attempt integer;
	p_fp bytea;
	round integer := 0;
	stalls integer := 0;
	ctx text;
BEGIN
	PERFORM idempotency._check_name(p_key, 'key', false);
	PERFORM idempotency._check_name(p_scope, 'scope', true);
	PERFORM idempotency._check_positive(p_lease, 'lease');
	PERFORM idempotency._check_positive(p_retention, 'retention');
	IF p_session_bound IS NULL THEN
		RAISE EXCEPTION 'session_bound must not be null' USING ERRCODE = '22004';
	END IF;
	PERFORM idempotency._check_writable(fn);
	PERFORM idempotency._tenant_check(caller, p_scope);
	PERFORM idempotency._check_catalog();
	IF p_request IS NOT NULL THEN
		p_fp := idempotency._fingerprint(p_request);
	END IF;
	busy := false;
	held := false;
	h := idempotency._key_hash(p_scope, p_key);

	LOOP
		round := round OPERATOR(pg_catalog.+) 1;
		EXIT WHEN round OPERATOR(pg_catalog.>) 2;
		now := pg_catalog.clock_timestamp();
		SELECT * INTO p FROM idempotency._probe(p_scope, p_key);
		-- claim_decide
		outcome := NULL; token := NULL; attempt := NULL; status := NULL;
		response_code := NULL; response_body := NULL; retry_after := NULL;
		phase := NULL; phase_data := NULL; lease_until := NULL;
		IF p.busy OR (NOT p.present AND
			pg_catalog.current_setting('idempotency_sql.probe_only', true) OPERATOR(pg_catalog.=) 'on') THEN
			-- busy, or absent while a waiting idem_claim knows that another
			-- transaction is inserting the key (see there)
			outcome := 'in_progress'; retry_after := 1; busy := true;
			RETURN;
		ELSIF NOT p.present OR p.expires_at OPERATOR(pg_catalog.<=) now THEN
			action := 'fresh';
		ELSIF p.fingerprint IS DISTINCT FROM p_fp THEN
			outcome := 'mismatch';
			RETURN;
		ELSIF p.status OPERATOR(pg_catalog.<>) 'pending' THEN
			outcome := 'replay'; status := p.status;
			response_code := p.response_code; response_body := p.response_body;
			RETURN;
		ELSIF p.token IS NOT NULL AND
			  (idempotency._held_here(p.mine, p.token) OR
			   (p.lease_until OPERATOR(pg_catalog.>) now AND
				(p.owner_session IS NULL OR idempotency._session_alive(p.owner_session)))) THEN
			outcome := 'in_progress';
			held := p.mine;
			lease_until := p.lease_until;
			retry_after := CASE WHEN p.mine THEN 1 ELSE
				LEAST(GREATEST(pg_catalog.ceil(EXTRACT(epoch FROM p.lease_until OPERATOR(pg_catalog.-) now)), 1),
					  2147483647)::integer END;
			RETURN;
		ELSE
			action := 'takeover';
		END IF;

		-- The write's lock_timeout is meant for another transaction's row
		-- of this key only: the table lock is waited for here, as the C
		-- edition waits for it, so that a DDL or LOCK TABLE in progress
		-- never reads as a busy key.
		LOCK TABLE idempotency.keys IN ROW EXCLUSIVE MODE;
		-- another backend is in this key's critical section right now
		IF NOT pg_catalog.pg_try_advisory_lock(idempotency._lock_class(), h) THEN
			outcome := 'in_progress'; retry_after := 1; busy := true;
			RETURN;
		END IF;
		BEGIN
			-- under the lock nobody else starts changing the key: look again
			SELECT * INTO p FROM idempotency._probe(p_scope, p_key);
			IF p.busy THEN
				action := 'busy';
			ELSIF NOT p.present AND NOT idempotency._mark_insert(h) THEN
				-- another transaction is inserting the key
				action := 'busy';
				PERFORM pg_catalog.set_config('idempotency_sql.unseen_insert', 'on', true);
			ELSIF NOT p.present OR p.expires_at OPERATOR(pg_catalog.<=) now THEN
				action := 'fresh';
			ELSIF p.fingerprint IS DISTINCT FROM p_fp OR p.status OPERATOR(pg_catalog.<>) 'pending' OR
				  (p.token IS NOT NULL AND
				   (idempotency._held_here(p.mine, p.token) OR
					(p.lease_until OPERATOR(pg_catalog.>) now AND
					 (p.owner_session IS NULL OR idempotency._session_alive(p.owner_session))))) THEN
				action := 'again';	-- changed since: decide once more
			ELSE
				action := 'takeover';
			END IF;
			IF action IN ('fresh', 'takeover') THEN
				owner := CASE WHEN p_session_bound THEN idempotency._session_binding() END;
				lease := COALESCE(p_lease,
					idempotency._guc_interval('idempotency.lease', 'ms', '00:00:30'));
				retention := COALESCE(p_retention,
					idempotency._guc_interval('idempotency.retention', 's', '24:00:00'));
				lease_until := now OPERATOR(pg_catalog.+) lease;
				expires := GREATEST(now OPERATOR(pg_catalog.+) retention, lease_until);
				token := pg_catalog.nextval('idempotency.token_seq'::regclass);
				new_attempt := CASE WHEN action OPERATOR(pg_catalog.=) 'fresh' THEN 1
					ELSE p.attempt OPERATOR(pg_catalog.+) 1 END;
				IF NOT idempotency._write_claim(p_scope, p_key,
						CASE WHEN p.present THEN p.tid END, token, new_attempt, p_fp,
						CASE WHEN action OPERATOR(pg_catalog.=) 'fresh' THEN now ELSE p.created_at END,
						now, lease_until, expires, retention,
						LEAST(p.sweep_at, lease_until),
						action OPERATOR(pg_catalog.=) 'takeover', owner) THEN
					-- the version probed was replaced by a change that
					-- committed since (see _probe): decide once more
					RAISE EXCEPTION 'version gone' USING ERRCODE = 'IDW03';
				END IF;
				IF pg_catalog.current_setting('idempotency_sql.xact_first_token', true) IS NULL OR
				   pg_catalog.current_setting('idempotency_sql.xact_first_token', true) OPERATOR(pg_catalog.=) '' THEN
					PERFORM pg_catalog.set_config('idempotency_sql.xact_first_token', token::text, true);
				END IF;
				outcome := 'claimed';
				attempt := new_attempt;
				IF action OPERATOR(pg_catalog.=) 'takeover' THEN
					phase := p.phase;
					phase_data := p.phase_data;
				END IF;
				lease_until := NULL;
			END IF;
		EXCEPTION
			WHEN lock_not_available THEN
				-- A wait for another transaction's row names that row version
				-- ("while inserting index tuple (0,2) in relation ...", in
				-- any language) in the innermost line of the context.  Any
				-- other wait that outlasted the write's 1 ms (the extension
				-- lock of the table or an index, taken while they grow) says
				-- nothing about the key: write again, without counting a
				-- round.
				GET STACKED DIAGNOSTICS ctx = PG_EXCEPTION_CONTEXT;
				IF pg_catalog.split_part(ctx, E'\n', 1) OPERATOR(pg_catalog.~) '[(][0-9]+,[0-9]+[)]' OR
				   stalls OPERATOR(pg_catalog.>=) 1000 THEN
					action := 'busy';
					IF NOT p.present THEN
						-- the insert met another transaction's uncommitted one
						PERFORM pg_catalog.set_config('idempotency_sql.unseen_insert', 'on', true);
					END IF;
				ELSE
					action := 'again';
					stalls := stalls OPERATOR(pg_catalog.+) 1;
					round := round OPERATOR(pg_catalog.-) 1;
				END IF;
			WHEN unique_violation OR SQLSTATE 'IDW03' THEN
				IF pg_catalog.current_setting('transaction_isolation') OPERATOR(pg_catalog.<>) 'read committed' THEN
					PERFORM pg_catalog.pg_advisory_unlock(idempotency._lock_class(), h);
					RAISE EXCEPTION 'could not serialize access due to concurrent update of an idempotency key'
						USING ERRCODE = '40001', HINT = 'Retry the transaction.';
				END IF;
				action := 'again';
				-- a version replaced under the probe is no round of its own:
				-- the change that replaced it has committed, and the next
				-- probe sees it
				IF SQLSTATE OPERATOR(pg_catalog.=) 'IDW03' AND stalls OPERATOR(pg_catalog.<) 1000 THEN
					stalls := stalls OPERATOR(pg_catalog.+) 1;
					round := round OPERATOR(pg_catalog.-) 1;
				END IF;
			WHEN OTHERS OR query_canceled THEN
				PERFORM pg_catalog.pg_advisory_unlock(idempotency._lock_class(), h);
				RAISE;
		END;
		PERFORM pg_catalog.pg_advisory_unlock(idempotency._lock_class(), h);
		IF outcome OPERATOR(pg_catalog.=) 'claimed' AND p_flush THEN
			PERFORM idempotency._flush_tokens();
		END IF;
		IF action OPERATOR(pg_catalog.=) 'busy' THEN
			outcome := 'in_progress'; retry_after := 1; busy := true;
			token := NULL; attempt := NULL; phase := NULL; phase_data := NULL;
			RETURN;
		END IF;
		IF outcome IS NOT NULL THEN
			RETURN;
		END IF;
	END LOOP;
	outcome := 'in_progress'; retry_after := 1; busy := true;
END;
$$;

/*
 * idem_claim: check the arguments, claim, and with "wait" poll until the
 * attempt in flight settles or its lease ends (the SQL edition cannot be
 * woken: it polls, 1 ms at first, backing off to 10 ms).
 */
CREATE OR REPLACE FUNCTION idempotency.idem_claim(
	key			text,
	request		jsonb		DEFAULT NULL,
	scope		text		DEFAULT '',
	lease		interval	DEFAULT NULL,
	retention	interval	DEFAULT NULL,
	wait		interval	DEFAULT '0',
	session_bound boolean	DEFAULT false)
RETURNS SETOF idempotency.claim_result
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE ROWS 1
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	w record;
	deadline timestamptz;
	now timestamptz;
	pause double precision := 0.001;
	sleep double precision;
	insert_at timestamptz;
	insert_every interval := '250 milliseconds';
BEGIN
	PERFORM idempotency._check_name(key, 'key', false);
	PERFORM idempotency._check_name(scope, 'scope', true);
	PERFORM idempotency._check_positive(lease, 'lease');
	PERFORM idempotency._check_positive(retention, 'retention');
	wait := idempotency._check_wait(wait);
	IF session_bound IS NULL THEN
		RAISE EXCEPTION 'session_bound must not be null' USING ERRCODE = '22004';
	END IF;
	PERFORM idempotency._check_writable('idem_claim()');
	PERFORM pg_catalog.set_config('idempotency_sql.unseen_insert', '', true);
	SELECT * INTO w FROM idempotency._w_claim(current_user, 'idem_claim()', key, request,
		scope, lease, retention, session_bound, true);
	IF w.outcome OPERATOR(pg_catalog.=) 'in_progress' AND NOT w.held
	   AND wait OPERATOR(pg_catalog.>) '0'::interval THEN
		deadline := pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) wait;
		-- A key that another transaction is inserting is invisible, and each
		-- insert of ours waits up to 1 ms for it in the unique check.  Once
		-- an insert met one, polls only probe (the key shows up when that
		-- transaction commits) and insert again only now and then (it
		-- may roll back): after 250 ms, then at doubling intervals up to 1 s.
		IF pg_catalog.current_setting('idempotency_sql.unseen_insert', true) OPERATOR(pg_catalog.=) 'on' THEN
			insert_at := pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) insert_every;
		END IF;
		LOOP
			now := pg_catalog.clock_timestamp();
			EXIT WHEN now OPERATOR(pg_catalog.>=) deadline;
			sleep := LEAST(pause, EXTRACT(epoch FROM deadline OPERATOR(pg_catalog.-) now)::double precision);
			IF w.lease_until IS NOT NULL AND w.lease_until OPERATOR(pg_catalog.>) now THEN
				sleep := LEAST(sleep, EXTRACT(epoch FROM w.lease_until OPERATOR(pg_catalog.-) now)::double precision);
			END IF;
			PERFORM pg_catalog.pg_sleep(GREATEST(sleep, 0.0005));
			pause := LEAST(pause OPERATOR(pg_catalog.*) 2, 0.01);
			IF insert_at IS NOT NULL AND pg_catalog.clock_timestamp() OPERATOR(pg_catalog.<) insert_at THEN
				PERFORM pg_catalog.set_config('idempotency_sql.probe_only', 'on', true);
			ELSIF insert_at IS NOT NULL THEN
				insert_every := LEAST(insert_every OPERATOR(pg_catalog.*) 2, '1 second'::interval);
				insert_at := pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) insert_every;
			END IF;
			PERFORM pg_catalog.set_config('idempotency_sql.unseen_insert', '', true);
			-- (an error rolls the transaction-local settings back with it)
			SELECT * INTO w FROM idempotency._w_claim(current_user, 'idem_claim()', key, request,
				scope, lease, retention, session_bound, true);
			PERFORM pg_catalog.set_config('idempotency_sql.probe_only', '', true);
			IF insert_at IS NULL AND
			   pg_catalog.current_setting('idempotency_sql.unseen_insert', true) OPERATOR(pg_catalog.=) 'on' THEN
				insert_at := pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) insert_every;
			END IF;
			EXIT WHEN w.outcome OPERATOR(pg_catalog.<>) 'in_progress' OR w.held;
		END LOOP;
	END IF;
	RETURN NEXT ROW(w.outcome, w.token, w.attempt, w.status, w.response_code,
		w.response_body, w.retry_after, w.phase, w.phase_data)::idempotency.claim_result;
END;
$$;

/*
 * idem_claim_many: every argument checked first, then each element claimed
 * as idem_claim (without wait) would, one after another.
 */
CREATE OR REPLACE FUNCTION idempotency.idem_claim_many(
	keys			text[],
	requests		jsonb[]		DEFAULT NULL,
	scope			text		DEFAULT '',
	lease			interval	DEFAULT NULL,
	retention		interval	DEFAULT NULL,
	session_bound	boolean		DEFAULT false)
RETURNS TABLE (ord integer, key text, outcome text, token bigint,
			   attempt integer, status text, response_code integer,
			   response_body jsonb, retry_after integer, phase text,
			   phase_data jsonb)
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE ROWS 100
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
	k text[];
	req jsonb[];
	n integer;
	w record;
	claimed boolean := false;
	no_marks text;
BEGIN
	PERFORM idempotency._check_array(pg_catalog.array_ndims(keys), 'keys', true, keys IS NULL);
	PERFORM idempotency._check_array(pg_catalog.array_ndims(requests), 'requests', false, requests IS NULL);
	k := ARRAY(SELECT u FROM pg_catalog.unnest(keys) u);
	n := pg_catalog.cardinality(k);
	IF requests IS NOT NULL THEN
		req := ARRAY(SELECT u FROM pg_catalog.unnest(requests) u);
		PERFORM idempotency._check_batch_length(pg_catalog.cardinality(req), 'requests', n);
	END IF;
	FOR i IN 1..n LOOP
		PERFORM idempotency._check_name(k[i], pg_catalog.format('keys[%s]', i), false);
	END LOOP;
	PERFORM idempotency._check_name(scope, 'scope', true);
	PERFORM idempotency._check_positive(lease, 'lease');
	PERFORM idempotency._check_positive(retention, 'retention');
	IF session_bound IS NULL THEN
		RAISE EXCEPTION 'session_bound must not be null' USING ERRCODE = '22004';
	END IF;
	PERFORM idempotency._check_writable('idem_claim_many()');
	PERFORM idempotency._tenant_check(current_user, scope);
	-- a batch marks all its fresh keys or none (_mark_insert)
	IF n OPERATOR(pg_catalog.>) (16 OPERATOR(pg_catalog.-)
		COALESCE(NULLIF(pg_catalog.current_setting('idempotency_sql.marks', true), '')::integer, 0)) THEN
		no_marks := COALESCE(pg_catalog.current_setting('idempotency_sql.no_marks', true), '');
		PERFORM pg_catalog.set_config('idempotency_sql.no_marks', 'on', true);
	END IF;
	FOR i IN 1..n LOOP
		SELECT * INTO w FROM idempotency._w_claim(current_user, 'idem_claim_many()', k[i], req[i],
			scope, lease, retention, session_bound, false);
		claimed := claimed OR w.outcome OPERATOR(pg_catalog.=) 'claimed';
		ord := i; key := k[i]; outcome := w.outcome; token := w.token;
		attempt := w.attempt; status := w.status; response_code := w.response_code;
		response_body := w.response_body; retry_after := w.retry_after;
		phase := w.phase; phase_data := w.phase_data;
		RETURN NEXT;
	END LOOP;
	IF no_marks IS NOT NULL THEN
		PERFORM pg_catalog.set_config('idempotency_sql.no_marks', no_marks, true);
	END IF;
	-- the rows leave when the function returns: one flush for all tokens
	IF claimed THEN
		PERFORM idempotency._flush_tokens();
	END IF;
END;
$$;
