/*-------------------------------------------------------------------------
 *
 * 32_abandoned.sql
 *	  idem_claim_abandoned: a completer takes over the keys whose attempt
 *	  was abandoned.
 *
 * Mirrors claim.c's idem_claim_abandoned and row.c's search for abandoned
 * keys: the candidates of one scope, oldest first (by created_at), from the three
 * places they are (keys_abandoned_idx, the due end of keys_sweep_at_idx,
 * keys_owner_session_idx); each locked as a claim locks an existing key
 * (FOR NO KEY UPDATE SKIP LOCKED, never waiting), judged again, and taken
 * over as a claim's takeover writes it.  Must not wait, and must not take
 * a key this transaction's own claim holds.
 *
 *-------------------------------------------------------------------------
 */

/* ---------------------------------------------------------------------
 * Completers (claim.c)
 * ---------------------------------------------------------------------
 */

/*
 * Take over, in one call, up to max_keys abandoned keys of the scope: a
 * key pending within its retention whose token a sweep cleared, whose
 * lease ended, or whose session-bound owner's session ended.  Oldest
 * first (ties: key); each row is a claimed takeover (attempt + 1, a new
 * token, the old one dead, a lease of "lease", not bound to a session),
 * with the request the key was claimed with when that claim kept it and
 * the last recovery point.  A key another transaction is changing or
 * locking, or that this transaction's own claim holds, is skipped, never
 * waited for.  The keys a sweep has not visited yet are looked for among
 * the first entries of the indexes every scope shares only (as many as
 * the C edition reads), so that a sweep's backlog does not make every
 * call read it whole: once a sweep resets them, keys_abandoned_idx finds
 * them by scope, the oldest first, a page at a time, so that a scope with
 * many reset keys costs a call only the ones it reads.
 */
CREATE OR REPLACE FUNCTION idempotency.idem_claim_abandoned(
	scope		text		DEFAULT '',
	max_keys	integer		DEFAULT 1,
	lease		interval	DEFAULT NULL)
RETURNS TABLE (key text, token bigint, attempt integer, request jsonb,
			   phase text, phase_data jsonb)
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE ROWS 10 SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
	who name := idempotency._caller();
	r record;
	c record;
	now timestamptz;
	lease_end timestamptz;
	cap integer;
	page integer;
	cur refcursor;
	seen integer;
	last_created timestamptz;
	last_key text;
	dead bigint[];
	first bigint;
	snap pg_snapshot;
	tids tid[] := '{}';
	ks text[] := '{}';
	attempts integer[] := '{}';
	requests jsonb[] := '{}';
	phases text[] := '{}';
	datas jsonb[] := '{}';
	toks bigint[];
	lsn pg_lsn;
	n integer := 0;
	got bigint;
	saved jsonb;
BEGIN
	PERFORM idempotency._check_name(scope, 'scope', true);
	IF max_keys IS NULL THEN
		RAISE EXCEPTION 'max_keys must not be null' USING ERRCODE = '22004';
	END IF;
	IF max_keys OPERATOR(pg_catalog.<) 1 OR max_keys OPERATOR(pg_catalog.>) 10000 THEN
		RAISE EXCEPTION 'max_keys must be between 1 and 10000' USING ERRCODE = '22023';
	END IF;
	PERFORM idempotency._check_positive(lease, 'lease');
	PERFORM idempotency._check_writable('idem_claim_abandoned()');
	IF pg_catalog.to_regclass('idempotency.keys') IS NULL OR
	   pg_catalog.to_regclass('idempotency.scope_bindings') IS NULL THEN
		PERFORM idempotency._check_store();
	END IF;
	-- Row exclusive on the table before the store's verdict is read (see
	-- idem_claim).
	LOCK TABLE idempotency.keys IN ROW EXCLUSIVE MODE;
	SELECT v.verdict, b.role IS NOT NULL AS bound, b.scope_prefix AS prefix
	  INTO r
	  FROM (SELECT idempotency._store_verdict() AS verdict,
				   'idempotency.token_seq'::pg_catalog.regclass AS seq) v
	  LEFT JOIN idempotency.scope_bindings b
		ON b.role::pg_catalog.oid OPERATOR(pg_catalog.=) pg_catalog.to_regrole(pg_catalog.quote_ident(who))
	  LEFT JOIN idempotency.keys k ON false;
	IF r.bound AND (r.prefix IS NULL OR NOT pg_catalog.starts_with(scope, r.prefix)) THEN
		PERFORM idempotency._tenant_refuse(who, scope, r.prefix);
	END IF;

	now := pg_catalog.clock_timestamp();
	lease_end := now OPERATOR(pg_catalog.+) COALESCE(lease, idempotency._lease_setting());
	cap := GREATEST(max_keys OPERATOR(pg_catalog.*) 16, 1024);
	page := max_keys OPERATOR(pg_catalog.*) 2 OPERATOR(pg_catalog.+) 8;
	-- the ended sessions among the owners of the scope's session-bound keys
	dead := ARRAY(SELECT s.o
					FROM (SELECT DISTINCT b.owner_session AS o
							FROM (SELECT k.owner_session, k.scope
									FROM idempotency.keys k
								   WHERE k.owner_session IS NOT NULL
								   LIMIT cap) b
						   WHERE b.scope OPERATOR(pg_catalog.=) idem_claim_abandoned.scope) s
				   WHERE NOT idempotency._session_alive(s.o));
	-- A claim of this transaction holds a key under a token it drew (from
	-- its first on), in a row version it wrote.
	first := NULLIF(pg_catalog.current_setting('idempotency_sql.xact_first_token', true), '')::bigint;
	IF first IS NOT NULL THEN
		snap := pg_catalog.pg_current_snapshot();
	END IF;

	-- The candidates in order, a page at a time (the next page starts after
	-- the last candidate of the one before), each joined to its row locked
	-- without waiting and judged again on its newest committed version
	-- (SKIP LOCKED reads it, and its conditions are checked once more
	-- there): a candidate another transaction holds, or no longer
	-- abandoned, joins no row.  Each row is fetched alone, so that the join
	-- locks no key past the max_keys-th (a loop over a query would read
	-- rows ahead).  A page holds the oldest reset keys of the scope by
	-- keys_abandoned_idx, as many as the page's size, and not every reset
	-- key the scope has.  The three kinds are disjoint: reset (token NULL),
	-- lease ended, session ended under a running lease.
	LOOP
		seen := 0;
		OPEN cur FOR
			SELECT a.key AS cand, a.created_at AS cand_created, l.tid, l.key, l.attempt,
				   l.request, l.phase, l.phase_data
			  FROM (SELECT b.key, b.created_at
					  FROM ((SELECT k.key, k.created_at
							   FROM idempotency.keys k
							  WHERE k.scope OPERATOR(pg_catalog.=) idem_claim_abandoned.scope
								AND k.token IS NULL
								AND k.created_at OPERATOR(pg_catalog.>=) COALESCE(last_created, '-infinity')
								AND (last_key IS NULL OR
									 (k.created_at, k.key) OPERATOR(pg_catalog.>) (last_created, last_key))
								AND k.status OPERATOR(pg_catalog.=) 'pending'
								AND k.expires_at OPERATOR(pg_catalog.>) now
							  ORDER BY k.created_at, k.key
							  LIMIT page)
							UNION ALL
							SELECT d.key, d.created_at
							  FROM (SELECT k.scope, k.key, k.status, k.token, k.lease_until, k.created_at, k.expires_at
									  FROM idempotency.keys k
									 WHERE k.sweep_at OPERATOR(pg_catalog.<=) now
									 ORDER BY k.sweep_at
									 LIMIT cap) d
							 WHERE d.scope OPERATOR(pg_catalog.=) idem_claim_abandoned.scope
							   AND d.token IS NOT NULL
							   AND d.status OPERATOR(pg_catalog.=) 'pending'
							   AND d.lease_until OPERATOR(pg_catalog.<=) now
							   AND d.expires_at OPERATOR(pg_catalog.>) now
							   AND (last_key IS NULL OR
									(d.created_at, d.key) OPERATOR(pg_catalog.>) (last_created, last_key))
							UNION ALL
							SELECT k.key, k.created_at
							  FROM idempotency.keys k
							 WHERE k.owner_session OPERATOR(pg_catalog.=) ANY (dead)
							   AND k.scope OPERATOR(pg_catalog.=) idem_claim_abandoned.scope
							   AND k.token IS NOT NULL
							   AND k.status OPERATOR(pg_catalog.=) 'pending'
							   AND k.lease_until OPERATOR(pg_catalog.>) now
							   AND k.expires_at OPERATOR(pg_catalog.>) now
							   AND (last_key IS NULL OR
									(k.created_at, k.key) OPERATOR(pg_catalog.>) (last_created, last_key))) b
					 ORDER BY b.created_at, b.key
					 LIMIT page) a
			  LEFT JOIN LATERAL (
				SELECT k.ctid AS tid, k.key, k.attempt, k.request, k.phase, k.phase_data
				  FROM idempotency.keys k
				 WHERE k.scope OPERATOR(pg_catalog.=) idem_claim_abandoned.scope
				   AND k.key OPERATOR(pg_catalog.=) a.key
				   AND k.status OPERATOR(pg_catalog.=) 'pending'
				   AND k.expires_at OPERATOR(pg_catalog.>) now
				   AND (k.token IS NULL OR k.lease_until OPERATOR(pg_catalog.<=) now OR
						k.owner_session OPERATOR(pg_catalog.=) ANY (dead))
				   AND k.attempt IS NOT NULL AND k.created_at IS NOT NULL
				   AND k.retention IS NOT NULL AND k.sweep_at IS NOT NULL
				   AND (k.fingerprint IS NULL OR pg_catalog.octet_length(k.fingerprint) OPERATOR(pg_catalog.=) 32)
				   AND NOT CASE WHEN k.token OPERATOR(pg_catalog.>=) first
								THEN pg_catalog.pg_xact_status(idempotency._xid8(k.xmin, snap))
									 IS NOT DISTINCT FROM 'in progress'
								ELSE false END
				   FOR NO KEY UPDATE OF k SKIP LOCKED) l ON true
			 ORDER BY a.created_at, a.key;
		LOOP
			EXIT WHEN n OPERATOR(pg_catalog.>=) max_keys;
			FETCH cur INTO c;
			EXIT WHEN NOT FOUND;
			seen := seen OPERATOR(pg_catalog.+) 1;
			last_created := c.cand_created;
			last_key := c.cand;
			CONTINUE WHEN c.tid IS NULL;
			tids := pg_catalog.array_append(tids, c.tid);
			ks := pg_catalog.array_append(ks, c.key);
			attempts := pg_catalog.array_append(attempts, c.attempt OPERATOR(pg_catalog.+) 1);
			requests := pg_catalog.array_append(requests, c.request);
			phases := pg_catalog.array_append(phases, c.phase);
			datas := pg_catalog.array_append(datas, c.phase_data);
			n := n OPERATOR(pg_catalog.+) 1;
		END LOOP;
		CLOSE cur;
		EXIT WHEN n OPERATOR(pg_catalog.>=) max_keys OR seen OPERATOR(pg_catalog.<) page;
	END LOOP;
	IF n OPERATOR(pg_catalog.=) 0 THEN
		RETURN;
	END IF;

	-- Each a claim's takeover: tokens in the order of the rows, the lease
	-- from now, the key's own retention, no session; created_at,
	-- fingerprint, remember, the kept request and the recovery point stay.
	IF r.verdict OPERATOR(pg_catalog.<>) 0 THEN
		PERFORM idempotency._refuse_write(r.verdict);
	END IF;
	toks := ARRAY(SELECT pg_catalog.nextval('idempotency.token_seq'::pg_catalog.regclass)
					FROM pg_catalog.generate_series(1, n));
	lsn := pg_catalog.pg_current_wal_insert_lsn();
	IF r.verdict OPERATOR(pg_catalog.&) 1 OPERATOR(pg_catalog.=) 0 THEN
		UPDATE idempotency.keys k
		   SET token = u.tok, attempt = k.attempt OPERATOR(pg_catalog.+) 1,
			   lease_until = lease_end,
			   expires_at = GREATEST(now OPERATOR(pg_catalog.+) k.retention,
									 lease_end),
			   sweep_at = LEAST(k.sweep_at, lease_end),
			   owner_session = NULL
		  FROM ROWS FROM (pg_catalog.unnest(tids), pg_catalog.unnest(toks)) u(tid, tok)
		 WHERE k.ctid OPERATOR(pg_catalog.=) ANY (tids)
		   AND k.ctid OPERATOR(pg_catalog.=) u.tid;
		GET DIAGNOSTICS got = ROW_COUNT;
		IF got OPERATOR(pg_catalog.<>) n THEN
			RAISE EXCEPTION 'idempotency key changed during a write'
				USING ERRCODE = '40001',
					  DETAIL = 'Someone changed idempotency.keys outside the extension''s functions.',
					  HINT = 'Retry the transaction.';
		END IF;
	END IF;
	FOR i IN 1..n LOOP
		IF r.verdict OPERATOR(pg_catalog.&) 1 OPERATOR(pg_catalog.<>) 0 THEN
			-- the table runs a user's code: row by row, the settings set
			-- back after each (see _sweep_rows); a row that code kept from
			-- being written is not taken over
			saved := idempotency._settings_save();
			UPDATE idempotency.keys k
			   SET token = toks[i], attempt = k.attempt OPERATOR(pg_catalog.+) 1,
				   lease_until = lease_end,
				   expires_at = GREATEST(now OPERATOR(pg_catalog.+) k.retention,
										 lease_end),
				   sweep_at = LEAST(k.sweep_at, lease_end),
				   owner_session = NULL
			 WHERE k.ctid OPERATOR(pg_catalog.=) tids[i];
			GET DIAGNOSTICS got = ROW_COUNT;
			PERFORM idempotency._settings_restore(saved);
			CONTINUE WHEN got OPERATOR(pg_catalog.=) 0;
		END IF;
		key := ks[i]; token := toks[i]; attempt := attempts[i];
		request := requests[i]; phase := phases[i]; phase_data := datas[i];
		RETURN NEXT;
	END LOOP;
	IF first IS NULL THEN
		PERFORM pg_catalog.set_config('idempotency_sql.xact_first_token', toks[1]::text, true);
	END IF;
	-- the rows leave when the function returns: one flush for all tokens
	IF pg_catalog.pg_current_wal_flush_lsn() OPERATOR(pg_catalog.<) lsn THEN
		PERFORM idempotency._flush_tokens(lsn);
	END IF;
END;
$$;
