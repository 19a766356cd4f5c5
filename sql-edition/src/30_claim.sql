/*-------------------------------------------------------------------------
 *
 * 30_claim.sql
 *	  idem_claim and idem_claim_many: the claim decision, its write and its
 *	  wait.
 *
 * Mirrors claim.c, with the claim's writes of write.c and the wait of
 * wait.c.  _claim_key decides (an expired outcome for a remembered key)
 * and writes one claim; idem_claim and idem_claim_many check their
 * arguments and call it, with their owner's rights; idem_claim waits when
 * asked to.  Keys serialise on what only
 * the table's owner can touch: the key's lane (key_lanes) for a new key,
 * the row's lock for an existing one, both held by the claiming
 * transaction to its end and never waited for unless the call was asked
 * to wait.  Must not touch a key it has not claimed: the calls that present
 * a token are in 35_holder.sql.
 *
 *-------------------------------------------------------------------------
 */

/* ---------------------------------------------------------------------
 * Claims (claim.c, write.c, wait.c)
 * ---------------------------------------------------------------------
 */

/*
 * The lane of (scope, key) in key_lanes: the scope's byte length first,
 * so that ("ab", "c") and ("a", "bc") differ.  An inlined SQL function:
 * the claim that locks a lane and the waiter that waits on it compute the
 * same number.
 */
CREATE OR REPLACE FUNCTION idempotency._key_lane(scope text, key text)
RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN pg_catalog.hashtext(pg_catalog.octet_length(scope)::text OPERATOR(pg_catalog.||) ':'
	OPERATOR(pg_catalog.||) scope OPERATOR(pg_catalog.||) key) OPERATOR(pg_catalog.&) 262143;

-- versions before 1.7.0 had no p_remember, before 1.8.0 no p_request
-- (01_update.sql)
DO $do$
BEGIN
	PERFORM idempotency._update_set_aside(
		'idempotency._claim_key(name,oid,text,bytea,text,interval,interval,boolean)');
	PERFORM idempotency._update_set_aside(
		'idempotency._claim_key(name,oid,text,bytea,text,interval,interval,boolean,interval)');
END;
$do$;

/*
 * One claim of (p_scope, p_key) for the role p_who (its oid p_role), the
 * arguments checked: answered from one read of the key, its binding and
 * the store's verdict when that read can answer (a replay, a mismatch, a
 * remembered key's expired, a live claim of another attempt: no lock, no
 * subtransaction), written otherwise:
 *   - a new key: its lane locked without waiting (key_lanes: a lane another
 *     transaction holds answers in_progress), then one INSERT ... ON
 *     CONFLICT DO NOTHING, which cannot wait, as no other claim inserts
 *     the key (a conflict is a claim that committed since the read);
 *   - a key whose attempt ended (lease over, session gone) or whose
 *     retention passed: the row locked without waiting (FOR NO KEY UPDATE
 *     SKIP LOCKED, which also reads its newest committed version), judged
 *     again and updated; a claim that writes stores p_remember (NULL: not
 *     remembered) and p_request, the request kept for a completer: a fresh
 *     claim stores it as it is (NULL: none), a takeover only when it is
 *     not NULL, and keeps the stored one otherwise (with keep_request and
 *     no request both are NULL, as the fingerprints match).
 * A row version another transaction is changing or locking right now
 * answers in_progress (_probe tells).  Besides the claim's columns it says
 * why a key is in progress ("busy": 'row' when another transaction holds
 * the row, 'lane' when it holds the key's lane, NULL for a claim that
 * committed), whether this transaction holds the claim itself ("held"),
 * until when the lease runs, and the WAL position the token needs flushed
 * before it leaves ("token_lsn").  It has no SET clause of its own (each
 * costs every call a settings change): it runs only inside idem_claim and
 * idem_claim_many, which pin search_path and the plan cache mode, and
 * names every object with its schema like every function here.
 */
CREATE OR REPLACE FUNCTION idempotency._claim_key(p_who name, p_role oid,
	p_key text, p_fp bytea, p_scope text, p_lease interval,
	p_retention interval, p_session_bound boolean, p_remember interval,
	p_request jsonb, OUT outcome text, OUT token bigint, OUT attempt integer, OUT status text,
	OUT response_code integer, OUT response_body jsonb, OUT retry_after integer,
	OUT phase text, OUT phase_data jsonb,
	OUT busy text, OUT held boolean, OUT lease_until timestamptz,
	OUT token_lsn pg_lsn)
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
	r record;
	p record;
	l record;
	now timestamptz;
	first text;
	action text;
	lease interval;
	ret interval;
	expires timestamptz;
	owner bigint;
	saved jsonb;
	n bigint;
	round integer := 0;
BEGIN
	held := false;
	IF pg_catalog.to_regclass('idempotency.keys') IS NULL OR
	   pg_catalog.to_regclass('idempotency.scope_bindings') IS NULL THEN
		PERFORM idempotency._check_store();
	END IF;
	LOOP
		round := round OPERATOR(pg_catalog.+) 1;
		EXIT WHEN round OPERATOR(pg_catalog.>) 3;
		SELECT v.verdict, b.role IS NOT NULL AS bound, b.scope_prefix AS prefix,
			   k.ctid IS NOT NULL AS present, false AS busy, false AS mine,
			   k.ctid AS tid, k.xmax AS xmax_, k.status, k.token, k.attempt,
			   k.fingerprint, k.response_code, k.response_body, k.created_at,
			   k.lease_until, k.expires_at, k.retention, k.sweep_at, k.phase,
			   k.phase_data, k.owner_session, k.remember
		  INTO r
		  FROM (SELECT idempotency._store_verdict() AS verdict,
					   'idempotency.token_seq'::pg_catalog.regclass AS seq) v
		  LEFT JOIN idempotency.scope_bindings b
			ON b.role::pg_catalog.oid OPERATOR(pg_catalog.=) p_role
		  LEFT JOIN idempotency.keys k
			ON k.scope OPERATOR(pg_catalog.=) p_scope AND k.key OPERATOR(pg_catalog.=) p_key;
		IF r.bound AND (r.prefix IS NULL OR NOT pg_catalog.starts_with(p_scope, r.prefix)) THEN
			PERFORM idempotency._tenant_refuse(p_who, p_scope, r.prefix);
		END IF;
		now := pg_catalog.clock_timestamp();
		p := r;
		IF r.present THEN
			IF r.status IS NULL OR r.attempt IS NULL OR r.created_at IS NULL OR
			   r.expires_at IS NULL OR r.retention IS NULL OR r.sweep_at IS NULL OR
			   r.status OPERATOR(pg_catalog.<>) ALL (ARRAY['pending', 'succeeded', 'failed']) OR
			   pg_catalog.octet_length(r.fingerprint) OPERATOR(pg_catalog.<>) 32 THEN
				PERFORM idempotency._check_row(p_scope, p_key, r.status, r.attempt,
					r.created_at, r.expires_at, r.retention, r.sweep_at, r.fingerprint);
			END IF;
			first := pg_catalog.current_setting('idempotency_sql.xact_first_token', true);
			-- A version that was locked or replaced, or a claim this
			-- transaction may have made itself: ask who holds it.
			IF r.xmax_ OPERATOR(pg_catalog.<>) '0'::xid OR
			   (r.status OPERATOR(pg_catalog.=) 'pending' AND first OPERATOR(pg_catalog.<>) '' AND
				r.token OPERATOR(pg_catalog.>=) first::bigint) THEN
				SELECT * INTO p FROM idempotency._probe(p_scope, p_key);
			END IF;
		END IF;

		-- claim_decide
		outcome := NULL; token := NULL; attempt := NULL; status := NULL;
		response_code := NULL; response_body := NULL; retry_after := NULL;
		phase := NULL; phase_data := NULL; lease_until := NULL; busy := NULL;
		IF p.busy THEN
			outcome := 'in_progress'; retry_after := 1; busy := 'row';
			RETURN;
		ELSIF NOT p.present OR (p.expires_at OPERATOR(pg_catalog.<=) now AND
			  NOT idempotency._remembered(p.status, p.expires_at, p.remember, now)) THEN
			action := 'fresh';
		ELSIF p.fingerprint IS DISTINCT FROM p_fp THEN
			outcome := 'mismatch';
			RETURN;
		ELSIF p.expires_at OPERATOR(pg_catalog.<=) now THEN
			-- remembered: it ran, and its response is gone; it never runs again
			outcome := 'expired'; status := p.status; response_code := p.response_code;
			RETURN;
		ELSIF p.status OPERATOR(pg_catalog.<>) 'pending' THEN
			outcome := 'replay'; status := p.status;
			response_code := p.response_code; response_body := p.response_body;
			RETURN;
		ELSIF p.token IS NOT NULL AND
			  ((p.mine AND first OPERATOR(pg_catalog.<>) '' AND p.token OPERATOR(pg_catalog.>=) first::bigint) OR
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

		-- a write: the verdict again, under the table's write lock
		r.verdict := idempotency._write_verdict();
		IF r.verdict OPERATOR(pg_catalog.<>) 0 THEN
			PERFORM idempotency._refuse_write(r.verdict);
			saved := idempotency._settings_save();
		END IF;
		owner := CASE WHEN p_session_bound THEN idempotency._session_binding() END;
		IF p_session_bound AND owner IS NULL THEN
			-- the functions' owner cannot see this backend's start: a binding
			-- that no one could check later would bind nothing
			RAISE EXCEPTION 'cannot bind a claim to this session'
				USING ERRCODE = '42501',
					  DETAIL = pg_catalog.format('Role "%s", which owns the idempotency functions, cannot read this session''s row of pg_stat_activity.', current_user),
					  HINT = 'GRANT pg_read_all_stats TO that role, or claim without session_bound.';
		END IF;
		lease := COALESCE(p_lease, idempotency._lease_setting());
		ret := COALESCE(p_retention, idempotency._retention_setting());
		lease_until := now OPERATOR(pg_catalog.+) lease;
		expires := GREATEST(now OPERATOR(pg_catalog.+) ret, lease_until);

		IF NOT p.present THEN
			-- The token first, and the WAL position just after it: the
			-- lane's lock writes WAL too, which the token need not wait for.
			token := pg_catalog.nextval('idempotency.token_seq'::pg_catalog.regclass);
			token_lsn := pg_catalog.pg_current_wal_insert_lsn();
			-- Another transaction inserting a key of this lane holds its
			-- lock (see key_lanes): in_progress, without waiting.
			PERFORM FROM idempotency.key_lanes kl
			 WHERE kl.lane OPERATOR(pg_catalog.=) idempotency._key_lane(p_scope, p_key)
			   FOR NO KEY UPDATE SKIP LOCKED;
			IF NOT FOUND THEN
				outcome := 'in_progress'; retry_after := 1; busy := 'lane';
				token := NULL; lease_until := NULL; token_lsn := NULL;
				RETURN;
			END IF;
			IF r.verdict OPERATOR(pg_catalog.&) 4 OPERATOR(pg_catalog.=) 0 THEN
				-- No other claim inserts this key now (we hold its lane): a
				-- conflict is a claim that committed since the read.
				INSERT INTO idempotency.keys AS k (scope, key, status, token, attempt,
					fingerprint, response_code, response_body, created_at, finished_at,
					lease_until, expires_at, retention, sweep_at, phase, phase_data,
					owner_session, remember, request)
				VALUES (p_scope, p_key, 'pending', _claim_key.token, 1, p_fp, NULL, NULL,
					now, NULL, _claim_key.lease_until, expires, ret, _claim_key.lease_until,
					NULL, NULL, owner, p_remember, p_request)
				ON CONFLICT (scope, key) DO NOTHING;
				GET DIAGNOSTICS n = ROW_COUNT;
			ELSE
				-- rules on the table: PostgreSQL refuses ON CONFLICT there
				BEGIN
					INSERT INTO idempotency.keys AS k (scope, key, status, token, attempt,
						fingerprint, response_code, response_body, created_at, finished_at,
						lease_until, expires_at, retention, sweep_at, phase, phase_data,
						owner_session, remember, request)
					VALUES (p_scope, p_key, 'pending', _claim_key.token, 1, p_fp, NULL, NULL,
						now, NULL, _claim_key.lease_until, expires, ret, _claim_key.lease_until,
						NULL, NULL, owner, p_remember, p_request);
					n := 1;
				EXCEPTION WHEN unique_violation THEN
					IF pg_catalog.current_setting('transaction_isolation') OPERATOR(pg_catalog.<>) 'read committed' THEN
						RAISE EXCEPTION 'could not serialize access due to concurrent update of an idempotency key'
							USING ERRCODE = '40001', HINT = 'Retry the transaction.';
					END IF;
					n := 0;
				END;
			END IF;
			IF n OPERATOR(pg_catalog.=) 0 THEN
				-- a claim committed since the read: decide once more
				token := NULL; lease_until := NULL; token_lsn := NULL;
				CONTINUE;
			END IF;
			attempt := 1;
		ELSE
			SELECT k.ctid AS tid, k.status, k.token, k.attempt, k.fingerprint,
				   k.created_at, k.lease_until, k.expires_at, k.sweep_at, k.phase,
				   k.phase_data, k.owner_session, k.remember
			  INTO l
			  FROM idempotency.keys k
			 WHERE k.scope OPERATOR(pg_catalog.=) p_scope AND k.key OPERATOR(pg_catalog.=) p_key
			   FOR NO KEY UPDATE SKIP LOCKED;
			IF NOT FOUND THEN
				-- another transaction holds the row (the next read says so),
				-- or it was deleted since (the next read finds no key)
				lease_until := NULL;
				CONTINUE;
			END IF;
			-- the newest committed version, locked: judge it once more
			IF l.expires_at OPERATOR(pg_catalog.<=) now AND
			   NOT idempotency._remembered(l.status, l.expires_at, l.remember, now) THEN
				action := 'fresh';
			ELSIF l.expires_at OPERATOR(pg_catalog.<=) now OR l.fingerprint IS DISTINCT FROM p_fp OR l.status OPERATOR(pg_catalog.<>) 'pending' OR
				  (l.token IS NOT NULL AND l.lease_until OPERATOR(pg_catalog.>) now AND
				   (l.owner_session IS NULL OR idempotency._session_alive(l.owner_session))) THEN
				lease_until := NULL;
				CONTINUE;		-- changed since the read: decide once more
			ELSE
				action := 'takeover';
			END IF;
			token := pg_catalog.nextval('idempotency.token_seq'::pg_catalog.regclass);
			token_lsn := pg_catalog.pg_current_wal_insert_lsn();
			IF action OPERATOR(pg_catalog.=) 'fresh' THEN
				attempt := 1;
				UPDATE idempotency.keys k
				   SET status = 'pending', token = _claim_key.token, attempt = 1,
					   fingerprint = p_fp, response_code = NULL, response_body = NULL,
					   created_at = now, finished_at = NULL,
					   lease_until = _claim_key.lease_until, expires_at = expires,
					   retention = ret, sweep_at = LEAST(l.sweep_at, _claim_key.lease_until),
					   phase = NULL, phase_data = NULL, owner_session = owner,
					   remember = p_remember, request = p_request
				 WHERE k.ctid OPERATOR(pg_catalog.=) l.tid;
			ELSE
				attempt := l.attempt OPERATOR(pg_catalog.+) 1;
				phase := l.phase;
				phase_data := l.phase_data;
				UPDATE idempotency.keys k
				   SET token = _claim_key.token, attempt = _claim_key.attempt,
					   lease_until = _claim_key.lease_until, expires_at = expires,
					   retention = ret, sweep_at = LEAST(l.sweep_at, _claim_key.lease_until),
					   owner_session = owner, remember = p_remember,
					   request = COALESCE(p_request, k.request)
				 WHERE k.ctid OPERATOR(pg_catalog.=) l.tid;
			END IF;
		END IF;
		IF saved IS NOT NULL THEN
			PERFORM idempotency._settings_restore(saved);
		END IF;
		IF first IS NULL OR first OPERATOR(pg_catalog.=) '' THEN
			first := pg_catalog.current_setting('idempotency_sql.xact_first_token', true);
			IF first IS NULL OR first OPERATOR(pg_catalog.=) '' THEN
				PERFORM pg_catalog.set_config('idempotency_sql.xact_first_token', token::text, true);
			END IF;
		END IF;
		outcome := 'claimed';
		lease_until := NULL;
		RETURN;
	END LOOP;
	outcome := 'in_progress'; retry_after := 1; busy := 'row';
	token := NULL; attempt := NULL; phase := NULL; phase_data := NULL;
	lease_until := NULL; token_lsn := NULL;
END;
$$;

/*
 * Make the token sequence's position durable before a token leaves the
 * server: a value handed out under a sequence record that is not flushed
 * yet could be handed out again after a crash.  "lsn" is the WAL insert
 * position read just after the token was drawn, at or past the end of the
 * sequence record that covers it (the draw that wrote the record held the
 * sequence's buffer lock until it was inserted): nothing to do when the
 * WAL is flushed that far (with other sessions writing, it seldom is:
 * their WAL lies before that position too).  SQL
 * cannot flush up to a position: from PostgreSQL 17 on a tiny
 * non-transactional WAL message flushes everything before it
 * (pg_logical_emit_message(..., flush)); before 17 the commit's flush is
 * all there is (documented).  Nor can a session remember that the record
 * covering some later tokens is already flushed: the first draw after a
 * checkpoint writes a new record for values the older one covered, and
 * after a crash the sequence resumes from the page that checkpoint wrote,
 * so only the WAL position after this very draw is safe to flush to.
 */
CREATE OR REPLACE FUNCTION idempotency._flush_tokens(lsn pg_lsn)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
	IF lsn IS NOT NULL AND pg_catalog.pg_current_wal_flush_lsn() OPERATOR(pg_catalog.<) lsn
	   AND pg_catalog.current_setting('server_version_num')::integer OPERATOR(pg_catalog.>=) 170000 THEN
		PERFORM pg_catalog.pg_logical_emit_message(false, 'idempotency', '', true);
	END IF;
END;
$$;

-- versions before 1.7.0 had no remember argument, before 1.8.0 no
-- keep_request (01_update.sql)
DO $do$
BEGIN
	PERFORM idempotency._update_set_aside(
		'idempotency.idem_claim(text,jsonb,text,interval,interval,interval,boolean)');
	PERFORM idempotency._update_set_aside(
		'idempotency.idem_claim(text,jsonb,text,interval,interval,interval,boolean,interval)');
END;
$do$;

/*
 * idem_claim: check the arguments, claim, and with "wait" wait until the
 * attempt in flight settles or its lease ends.  Most calls of a busy key
 * are answered by its first statement alone: with plain arguments, one
 * query reads the key, the caller's binding and the store's verdict and
 * answers a replay, a mismatch or a live claim of another attempt (without
 * "wait") when the key's newest version is committed and untouched
 * (xmax = 0), the row sound, the scope allowed and not past retention.
 * Everything else (a new, expired or remembered key, a takeover, a row
 * being changed, a claim of this transaction, a refusal, a bad argument)
 * takes the full path below, which decides again from scratch.  A key another transaction
 * holds (a claim, takeover, finish, release or sweep not committed yet) is
 * waited for as PostgreSQL waits for that transaction, on the row's lock
 * or the key's lane's, so the wait ends when that transaction (or the
 * savepoint it made the change in) does.  A key held by an attempt whose
 * claim committed is polled, 1 ms at first, backing off to 10 ms, and
 * never past the lease's end.  With keep_request a claim that writes keeps
 * the request for a completer (idem_claim_abandoned), and a request larger
 * than a response body may be is refused before anything is read.
 */
CREATE OR REPLACE FUNCTION idempotency.idem_claim(
	key			text,
	request		jsonb		DEFAULT NULL,
	scope		text		DEFAULT '',
	lease		interval	DEFAULT NULL,
	retention	interval	DEFAULT NULL,
	wait		interval	DEFAULT '0',
	session_bound boolean	DEFAULT false,
	remember	interval	DEFAULT NULL,
	keep_request boolean	DEFAULT false)
RETURNS SETOF idempotency.claim_result
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE ROWS 1 SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
	who name;
	role oid;
	w record;
	fp bytea;
	deadline timestamptz;
	now timestamptz;
	pause double precision := 0.001;
	sleep double precision;
	remaining bigint;
	tok bigint;
	lsn pg_lsn;
	ls interval;
	rt interval;
	rem interval;
	kept jsonb;
BEGIN
	IF NOT (key IS NULL OR pg_catalog.octet_length(key) OPERATOR(pg_catalog.=) 0 OR
			pg_catalog.octet_length(key) OPERATOR(pg_catalog.>) 255 OR
			scope IS NULL OR pg_catalog.octet_length(scope) OPERATOR(pg_catalog.>) 255 OR
			wait IS NULL OR wait OPERATOR(pg_catalog.<) '0'::interval OR session_bound IS NULL OR
			(lease IS NOT NULL AND NOT (lease OPERATOR(pg_catalog.>) '0'::interval AND
				lease OPERATOR(pg_catalog.<=) '10000 years'::interval AND
				pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) lease OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp())) OR
			(retention IS NOT NULL AND NOT (retention OPERATOR(pg_catalog.>) '0'::interval AND
				retention OPERATOR(pg_catalog.<=) '10000 years'::interval AND
				pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) retention OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp())) OR
			(remember IS NOT NULL AND NOT (remember OPERATOR(pg_catalog.=) '0'::interval OR
				(remember OPERATOR(pg_catalog.>) '0'::interval AND
				 remember OPERATOR(pg_catalog.<=) '10000 years'::interval AND
				 pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) remember OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp()))) OR
			(keep_request AND idempotency._request_too_large(request)) OR
			pg_catalog.pg_is_in_recovery() OR pg_catalog.current_setting('transaction_read_only')::boolean OR
			pg_catalog.to_regclass('idempotency.keys') IS NULL OR
			pg_catalog.to_regclass('idempotency.scope_bindings') IS NULL) THEN
		-- One read answers, or says nothing (the full path then decides).
		-- A replay or a mismatch is answered from a version nobody locked
		-- (xmax 0) or only its own writer, which has ended or is this
		-- transaction (xmax = xmin: a token call locks the row it then
		-- updates, and the new version keeps that lock); a live claim only
		-- from a version nobody locked.  A key past its retention, remembered
		-- or not, is the full path's, so that this query's plan stays that
		-- of a key without remember.
		SELECT CASE
				 WHEN v.verdict IS NULL OR v.refused THEN NULL
				 WHEN k.ctid IS NULL THEN
					  CASE WHEN v.verdict OPERATOR(pg_catalog.=) 0 AND NOT idem_claim.session_bound
						   THEN 'fresh' END
				 WHEN k.expires_at OPERATOR(pg_catalog.<=) v.now OR
					  pg_catalog.octet_length(k.fingerprint) OPERATOR(pg_catalog.<>) 32 OR
					  (k.xmax OPERATOR(pg_catalog.<>) '0'::xid AND k.xmax OPERATOR(pg_catalog.<>) k.xmin) THEN NULL
				 WHEN k.fingerprint IS DISTINCT FROM v.fp THEN
					  CASE WHEN k.status OPERATOR(pg_catalog.=) ANY (ARRAY['pending', 'succeeded', 'failed'])
						   THEN 'mismatch' END
				 WHEN k.status OPERATOR(pg_catalog.=) ANY (ARRAY['succeeded', 'failed']) THEN 'replay'
				 WHEN k.status OPERATOR(pg_catalog.=) 'pending' AND k.xmax OPERATOR(pg_catalog.=) '0'::xid AND
					  idem_claim.wait OPERATOR(pg_catalog.=) '0'::interval AND
					  k.token IS NOT NULL AND k.owner_session IS NULL AND
					  k.lease_until OPERATOR(pg_catalog.>) v.now AND
					  (COALESCE(v.first, '') OPERATOR(pg_catalog.=) '' OR
					   k.token OPERATOR(pg_catalog.<) v.first::bigint) THEN 'in_progress'
				 END AS outcome,
			   k.status, k.response_code, k.response_body,
			   LEAST(GREATEST(pg_catalog.ceil(EXTRACT(epoch FROM k.lease_until OPERATOR(pg_catalog.-) v.now)), 1),
					 2147483647)::integer AS retry_after,
			   v.fp, v.first
		  INTO w
		  FROM (SELECT idempotency._store_verdict() AS verdict,
					   'idempotency.token_seq'::pg_catalog.regclass AS seq,
					   pg_catalog.clock_timestamp() AS now,
					   CASE WHEN idem_claim.request IS NOT NULL THEN
						   pg_catalog.sha256(pg_catalog.convert_to(idem_claim.request::text,
							   pg_catalog.getdatabaseencoding())) END AS fp,
					   pg_catalog.current_setting('idempotency_sql.xact_first_token', true) AS first,
					   -- any binding row of the caller that refuses the scope
					   EXISTS (SELECT FROM idempotency.scope_bindings b
							   WHERE b.role::pg_catalog.oid OPERATOR(pg_catalog.=)
									 pg_catalog.to_regrole(pg_catalog.quote_ident(idempotency._caller()))
								 AND (b.scope_prefix IS NULL OR
									  NOT pg_catalog.starts_with(idem_claim.scope, b.scope_prefix))) AS refused) v
		  LEFT JOIN idempotency.keys k
			ON k.scope OPERATOR(pg_catalog.=) idem_claim.scope
		   AND k.key OPERATOR(pg_catalog.=) idem_claim.key;
		IF w.outcome OPERATOR(pg_catalog.=) 'replay' THEN
			RETURN NEXT ROW('replay', NULL, NULL, w.status, w.response_code,
				w.response_body, NULL, NULL, NULL)::idempotency.claim_result;
			RETURN;
		ELSIF w.outcome OPERATOR(pg_catalog.=) 'fresh' THEN
			-- A new key, no code attached to the table: the token, the
			-- lane's lock and the insert, as _claim_key makes them.  A busy
			-- lane or a key committed since the read takes the full path.
			ls := COALESCE(lease, idempotency._lease_setting());
			rt := COALESCE(retention, idempotency._retention_setting());
			-- the verdict again, under the table's write lock
			IF idempotency._write_verdict() OPERATOR(pg_catalog.=) 0 THEN
				tok := pg_catalog.nextval('idempotency.token_seq'::pg_catalog.regclass);
				lsn := pg_catalog.pg_current_wal_insert_lsn();
				PERFORM FROM idempotency.key_lanes kl
				 WHERE kl.lane OPERATOR(pg_catalog.=) idempotency._key_lane(idem_claim.scope, idem_claim.key)
				   FOR NO KEY UPDATE SKIP LOCKED;
			END IF;
			IF tok IS NOT NULL AND FOUND THEN
				now := pg_catalog.clock_timestamp();
				INSERT INTO idempotency.keys AS k (scope, key, status, token, attempt,
					fingerprint, response_code, response_body, created_at, finished_at,
					lease_until, expires_at, retention, sweep_at, phase, phase_data,
					owner_session, remember, request)
				VALUES (idem_claim.scope, idem_claim.key, 'pending', tok, 1, w.fp,
					NULL, NULL, now, NULL, now OPERATOR(pg_catalog.+) ls,
					GREATEST(now OPERATOR(pg_catalog.+) rt, now OPERATOR(pg_catalog.+) ls),
					rt, now OPERATOR(pg_catalog.+) ls, NULL, NULL, NULL,
					CASE WHEN idem_claim.remember IS NULL THEN idempotency._remember_setting()
						 ELSE NULLIF(idem_claim.remember, '0'::interval) END,
					CASE WHEN idem_claim.keep_request THEN idem_claim.request END)
				ON CONFLICT ON CONSTRAINT keys_pkey DO NOTHING;
				IF FOUND THEN
					IF COALESCE(w.first, '') OPERATOR(pg_catalog.=) '' THEN
						PERFORM pg_catalog.set_config('idempotency_sql.xact_first_token', tok::text, true);
					END IF;
					IF pg_catalog.pg_current_wal_flush_lsn() OPERATOR(pg_catalog.<) lsn THEN
						PERFORM idempotency._flush_tokens(lsn);
					END IF;
					RETURN NEXT ROW('claimed', tok, 1, NULL, NULL, NULL, NULL, NULL,
						NULL)::idempotency.claim_result;
					RETURN;
				END IF;
			END IF;
		ELSIF w.outcome IS NOT NULL THEN
			RETURN NEXT ROW(w.outcome, NULL, NULL, NULL, NULL, NULL,
				CASE WHEN w.outcome OPERATOR(pg_catalog.=) 'in_progress' THEN w.retry_after END,
				NULL, NULL)::idempotency.claim_result;
			RETURN;
		END IF;
	END IF;

	who := idempotency._caller();
	role := pg_catalog.to_regrole(pg_catalog.quote_ident(who));
	IF key IS NULL OR pg_catalog.octet_length(key) OPERATOR(pg_catalog.=) 0 OR
	   pg_catalog.octet_length(key) OPERATOR(pg_catalog.>) 255 THEN
		PERFORM idempotency._check_name(key, 'key', false);
	END IF;
	IF scope IS NULL OR pg_catalog.octet_length(scope) OPERATOR(pg_catalog.>) 255 THEN
		PERFORM idempotency._check_name(scope, 'scope', true);
	END IF;
	IF lease IS NOT NULL THEN
		PERFORM idempotency._check_positive(lease, 'lease');
	END IF;
	IF retention IS NOT NULL THEN
		PERFORM idempotency._check_positive(retention, 'retention');
	END IF;
	IF wait IS NULL OR wait OPERATOR(pg_catalog.<>) '0'::interval THEN
		wait := idempotency._check_wait(wait);
	END IF;
	IF session_bound IS NULL THEN
		RAISE EXCEPTION 'session_bound must not be null' USING ERRCODE = '22004';
	END IF;
	IF remember IS NOT NULL THEN
		PERFORM idempotency._check_interval(remember, 'remember', true);
	END IF;
	IF keep_request THEN
		PERFORM idempotency._check_body(request, 'request');
	END IF;
	IF pg_catalog.pg_is_in_recovery() OR pg_catalog.current_setting('transaction_read_only')::boolean THEN
		PERFORM idempotency._check_writable('idem_claim()');
	END IF;
	rem := CASE WHEN remember IS NULL THEN idempotency._remember_setting()
		   ELSE NULLIF(remember, '0'::interval) END;
	IF keep_request THEN
		kept := request;
	END IF;
	IF request IS NOT NULL THEN
		fp := pg_catalog.sha256(pg_catalog.convert_to(request::text, pg_catalog.getdatabaseencoding()));
	END IF;
	w := idempotency._claim_key(who, role, key, fp,
		scope, lease, retention, session_bound, rem, kept);
	IF w.outcome OPERATOR(pg_catalog.=) 'in_progress' AND NOT w.held
	   AND wait OPERATOR(pg_catalog.>) '0'::interval THEN
		deadline := pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) wait;
		LOOP
			now := pg_catalog.clock_timestamp();
			EXIT WHEN now OPERATOR(pg_catalog.>=) deadline;
			remaining := GREATEST(pg_catalog.ceil(EXTRACT(epoch FROM deadline OPERATOR(pg_catalog.-) now)
				OPERATOR(pg_catalog.*) 1000), 1)::bigint;
			IF w.busy OPERATOR(pg_catalog.=) 'row' THEN
				-- Wait for the transaction that holds the row as a row lock
				-- waits (so a deadlock is detected), and let the lock go at
				-- once: it only served to wait.  FOR SHARE conflicts with
				-- every change a claim, finish, release or sweep makes.
				BEGIN
					PERFORM pg_catalog.set_config('lock_timeout', remaining::text OPERATOR(pg_catalog.||) 'ms', true);
					PERFORM FROM idempotency.keys k
					 WHERE k.scope OPERATOR(pg_catalog.=) idem_claim.scope
					   AND k.key OPERATOR(pg_catalog.=) idem_claim.key
					   FOR SHARE;
					RAISE EXCEPTION 'waited' USING ERRCODE = 'IDW01';
				EXCEPTION WHEN SQLSTATE 'IDW01' OR lock_not_available THEN
					NULL;
				END;
			ELSIF w.busy OPERATOR(pg_catalog.=) 'lane' THEN
				-- another transaction inserts a key of this lane: wait on the
				-- lane's lock, which it holds to its end (or its savepoint's)
				BEGIN
					PERFORM pg_catalog.set_config('lock_timeout', remaining::text OPERATOR(pg_catalog.||) 'ms', true);
					PERFORM FROM idempotency.key_lanes kl
					 WHERE kl.lane OPERATOR(pg_catalog.=) idempotency._key_lane(idem_claim.scope, idem_claim.key)
					   FOR SHARE;
					RAISE EXCEPTION 'waited' USING ERRCODE = 'IDW01';
				EXCEPTION WHEN SQLSTATE 'IDW01' OR lock_not_available THEN
					NULL;
				END;
			ELSE
				-- a claim that committed: poll
				sleep := LEAST(pause, EXTRACT(epoch FROM deadline OPERATOR(pg_catalog.-) now)::double precision);
				IF w.lease_until IS NOT NULL AND w.lease_until OPERATOR(pg_catalog.>) now THEN
					sleep := LEAST(sleep, EXTRACT(epoch FROM w.lease_until OPERATOR(pg_catalog.-) now)::double precision);
				END IF;
				PERFORM pg_catalog.pg_sleep(GREATEST(sleep, 0.0005));
				pause := LEAST(pause OPERATOR(pg_catalog.*) 2, 0.01);
			END IF;
			w := idempotency._claim_key(who, role, key, fp,
				scope, lease, retention, session_bound, rem, kept);
			EXIT WHEN w.outcome OPERATOR(pg_catalog.<>) 'in_progress' OR w.held;
		END LOOP;
	END IF;
	IF w.token_lsn IS NOT NULL AND pg_catalog.pg_current_wal_flush_lsn() OPERATOR(pg_catalog.<) w.token_lsn THEN
		PERFORM idempotency._flush_tokens(w.token_lsn);
	END IF;
	RETURN NEXT ROW(w.outcome, w.token, w.attempt, w.status, w.response_code,
		w.response_body, w.retry_after, w.phase, w.phase_data)::idempotency.claim_result;
END;
$$;

/*
 * idem_claim_many: every argument checked first, then each element claimed
 * as idem_claim (without wait, remember from idempotency.remember, no
 * request kept) would, one after another; the tokens are made durable
 * once, before the rows leave.
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
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE ROWS 100 SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
	who name := idempotency._caller();
	role oid;
	k text[];
	req jsonb[];
	n integer;
	w record;
	lsn pg_lsn;
	ls interval;
	rt interval;
	now timestamptz;
	toks bigint[];
	lanes integer[];
	got bigint;
	verdict integer;
	rem interval;
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
		IF k[i] IS NULL OR pg_catalog.octet_length(k[i]) OPERATOR(pg_catalog.=) 0 OR
		   pg_catalog.octet_length(k[i]) OPERATOR(pg_catalog.>) 255 THEN
			PERFORM idempotency._check_name(k[i], pg_catalog.format('keys[%s]', i), false);
		END IF;
	END LOOP;
	PERFORM idempotency._check_name(scope, 'scope', true);
	PERFORM idempotency._check_positive(lease, 'lease');
	PERFORM idempotency._check_positive(retention, 'retention');
	IF session_bound IS NULL THEN
		RAISE EXCEPTION 'session_bound must not be null' USING ERRCODE = '22004';
	END IF;
	PERFORM idempotency._check_writable('idem_claim_many()');
	role := pg_catalog.to_regrole(pg_catalog.quote_ident(who));
	rem := idempotency._remember_setting();
	-- A batch of new keys, no code attached to the table, the scope allowed,
	-- not bound to the session: the tokens drawn in order, every key's lane
	-- locked without waiting, and the rows inserted by one statement, as
	-- _claim_key makes each.  All or nothing: when a lane is busy or a key
	-- was claimed meanwhile, the block's subtransaction takes back what it
	-- did (lanes and rows, not the tokens) and every element takes the loop
	-- below, in order.  Before it writes, the verdict again under the
	-- table's write lock (_write_verdict).
	IF n OPERATOR(pg_catalog.>) 0 AND NOT session_bound AND
	   pg_catalog.to_regclass('idempotency.keys') IS NOT NULL AND
	   pg_catalog.to_regclass('idempotency.scope_bindings') IS NOT NULL AND
	   (SELECT v.verdict OPERATOR(pg_catalog.=) 0 AND
			   NOT EXISTS (SELECT FROM idempotency.scope_bindings b
						   WHERE b.role::pg_catalog.oid OPERATOR(pg_catalog.=) pg_catalog.to_regrole(pg_catalog.quote_ident(who))
							 AND (b.scope_prefix IS NULL OR
								  NOT pg_catalog.starts_with(idem_claim_many.scope, b.scope_prefix))) AND
			   (SELECT pg_catalog.count(DISTINCT u) FROM pg_catalog.unnest(k) u) OPERATOR(pg_catalog.=) n AND
			   NOT EXISTS (SELECT FROM pg_catalog.unnest(k) u
						   CROSS JOIN LATERAL (
							 SELECT FROM idempotency.keys kk
							  WHERE kk.scope OPERATOR(pg_catalog.=) idem_claim_many.scope
								AND kk.key OPERATOR(pg_catalog.=) u
							  LIMIT 1) kk)
		  FROM (SELECT idempotency._store_verdict() AS verdict,
					   'idempotency.token_seq'::pg_catalog.regclass AS seq) v) THEN
		verdict := idempotency._write_verdict();
	END IF;
	IF verdict OPERATOR(pg_catalog.=) 0 THEN
		ls := COALESCE(lease, idempotency._lease_setting());
		rt := COALESCE(retention, idempotency._retention_setting());
		BEGIN
			toks := ARRAY(SELECT pg_catalog.nextval('idempotency.token_seq'::pg_catalog.regclass)
							FROM pg_catalog.generate_series(1, n));
			lsn := pg_catalog.pg_current_wal_insert_lsn();
			lanes := ARRAY(SELECT DISTINCT idempotency._key_lane(idem_claim_many.scope, u)
							 FROM pg_catalog.unnest(k) u);
			-- lane by lane (a lateral lookup each: no plan scans the lanes
			-- once per element)
			PERFORM FROM pg_catalog.unnest(lanes) l
			  CROSS JOIN LATERAL (
				SELECT FROM idempotency.key_lanes kl
				 WHERE kl.lane OPERATOR(pg_catalog.=) l
				   FOR NO KEY UPDATE SKIP LOCKED) kl;
			GET DIAGNOSTICS got = ROW_COUNT;
			IF got OPERATOR(pg_catalog.<>) pg_catalog.cardinality(lanes) THEN
				RAISE EXCEPTION 'a lane is busy' USING ERRCODE = 'IDB01';
			END IF;
			now := pg_catalog.clock_timestamp();
			INSERT INTO idempotency.keys AS kk (scope, key, status, token, attempt,
				fingerprint, response_code, response_body, created_at, finished_at,
				lease_until, expires_at, retention, sweep_at, phase, phase_data,
				owner_session, remember)
			SELECT idem_claim_many.scope, u.key, 'pending', u.tok, 1,
				   CASE WHEN u.req IS NOT NULL THEN
					   pg_catalog.sha256(pg_catalog.convert_to(u.req::text,
						   pg_catalog.getdatabaseencoding())) END,
				   NULL, NULL, now, NULL, now OPERATOR(pg_catalog.+) ls,
				   GREATEST(now OPERATOR(pg_catalog.+) rt, now OPERATOR(pg_catalog.+) ls),
				   rt, now OPERATOR(pg_catalog.+) ls, NULL, NULL, NULL, rem
			  FROM ROWS FROM (pg_catalog.unnest(k), pg_catalog.unnest(toks), pg_catalog.unnest(req))
				   WITH ORDINALITY u(key, tok, req, i)
			 ORDER BY u.i
			ON CONFLICT ON CONSTRAINT keys_pkey DO NOTHING;
			GET DIAGNOSTICS got = ROW_COUNT;
			IF got OPERATOR(pg_catalog.<>) n THEN
				RAISE EXCEPTION 'a key was claimed meanwhile' USING ERRCODE = 'IDB01';
			END IF;
		EXCEPTION WHEN SQLSTATE 'IDB01' THEN
			toks := NULL;
		END;
		IF toks IS NOT NULL THEN
			IF COALESCE(pg_catalog.current_setting('idempotency_sql.xact_first_token', true), '')
				   OPERATOR(pg_catalog.=) '' THEN
				PERFORM pg_catalog.set_config('idempotency_sql.xact_first_token', toks[1]::text, true);
			END IF;
			IF pg_catalog.pg_current_wal_flush_lsn() OPERATOR(pg_catalog.<) lsn THEN
				PERFORM idempotency._flush_tokens(lsn);
			END IF;
			RETURN QUERY SELECT u.i::integer, u.key, 'claimed'::text, u.tok, 1,
				NULL::text, NULL::integer, NULL::jsonb, NULL::integer, NULL::text, NULL::jsonb
			  FROM ROWS FROM (pg_catalog.unnest(k), pg_catalog.unnest(toks)) WITH ORDINALITY u(key, tok, i);
			RETURN;
		END IF;
		lsn := NULL;
	END IF;
	FOR i IN 1..n LOOP
		w := idempotency._claim_key(who, role, k[i],
			CASE WHEN req[i] IS NOT NULL THEN
				pg_catalog.sha256(pg_catalog.convert_to(req[i]::text, pg_catalog.getdatabaseencoding())) END,
			scope, lease, retention, session_bound, rem, NULL);
		IF w.token_lsn IS NOT NULL THEN
			lsn := GREATEST(lsn, w.token_lsn);
		END IF;
		ord := i; key := k[i]; outcome := w.outcome; token := w.token;
		attempt := w.attempt; status := w.status; response_code := w.response_code;
		response_body := w.response_body; retry_after := w.retry_after;
		phase := w.phase; phase_data := w.phase_data;
		RETURN NEXT;
	END LOOP;
	-- the rows leave when the function returns: one flush for all tokens
	PERFORM idempotency._flush_tokens(lsn);
END;
$$;
