/*
 * bench/setup.sql: the plain tables of the comparison rows, created by
 * bench/run in its throwaway cluster.  Same column shape as
 * idempotency.keys, primary key only (no sweep_at index), except row 24's
 * second floor, which has that index too.
 */
CREATE SCHEMA bench;

-- row 7, the floor: bare INSERT + UPDATE, no checks
CREATE TABLE bench.floor_keys (
	scope			text COLLATE "C" NOT NULL,
	key				text COLLATE "C" NOT NULL,
	status			text COLLATE "C" NOT NULL,
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
	PRIMARY KEY (scope, key)
);

-- rows 3-5, the seed SQL patterns
CREATE TABLE bench.seed_keys (LIKE bench.floor_keys INCLUDING ALL);

-- row 24's second floor: the same table with an index on sweep_at, as the
-- extension's table has, so that the cost of that index shows on its own
CREATE TABLE bench.floor_sweep_keys (LIKE bench.floor_keys INCLUDING ALL);
CREATE INDEX ON bench.floor_sweep_keys (sweep_at);

-- the bound of row 1 vs row 6: two minimal durable commits (r7c_two_commits.sql)
CREATE TABLE bench.commit_probe (k bigint);

-- the business write of rows 2 and 3
CREATE TABLE bench.orders (
	id		bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
	scope	text NOT NULL,
	key		text NOT NULL,
	amount	integer NOT NULL
);

/*
 * Fill a keys-shaped table with n finished (or, with expired, past-retention;
 * with pending, live-lease pending) keys named '1'..'n' in scope, through
 * INSERT ... SELECT, not through the API.  Keys are 36 characters like a
 * UUID when wide is true (row 12's size per key), else the decimal number.
 * Row 25's kinds need the remember column (1.7): remembered, the compact
 * record a sweep leaves of a finished key past its retention (remembered
 * for 30 days); remember_due, a finished key whose retention just passed,
 * which the next sweep compacts.
 */
CREATE FUNCTION bench.fill(tbl regclass, p_scope text, n bigint,
						   kind text DEFAULT 'finished', wide boolean DEFAULT false,
						   first bigint DEFAULT 1)
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
	c bigint;
	remembered CONSTANT boolean := kind IN ('remembered', 'remember_due');
BEGIN
	EXECUTE format($f$
		INSERT INTO %s (scope, key, status, token, attempt, fingerprint,
						response_code, response_body, created_at, finished_at,
						lease_until, expires_at, retention, sweep_at%s)
		SELECT $1, CASE WHEN $4 THEN gen_random_uuid()::text ELSE i::text END,
			   CASE $3 WHEN 'pending' THEN 'pending' ELSE 'succeeded' END,
			   i, 1,
			   sha256(convert_to('{"amount": 100}'::jsonb::text, 'UTF8')),
			   CASE $3 WHEN 'pending' THEN NULL ELSE 200 END,
			   CASE WHEN $3 IN ('pending', 'remembered') THEN NULL
					ELSE '{"id": 1, "ok": true}'::jsonb END,
			   now() - interval '1 hour',
			   CASE $3 WHEN 'pending' THEN NULL ELSE now() - interval '1 hour' END,
			   CASE $3 WHEN 'pending' THEN now() + interval '1 day' END,
			   CASE WHEN $3 IN ('expired', 'remembered', 'remember_due')
					THEN now() - interval '1 minute'
					ELSE now() + interval '1 day' END,
			   interval '1 day',
			   CASE $3 WHEN 'remembered' THEN now() - interval '1 minute' + interval '30 days'
					   WHEN 'expired' THEN now() - interval '1 minute'
					   WHEN 'remember_due' THEN now() - interval '1 minute'
					   ELSE now() + interval '1 day' END%s
		  FROM generate_series($5, $5 + $2 - 1) AS i$f$, tbl,
		  CASE WHEN remembered THEN ', remember' ELSE '' END,
		  CASE WHEN remembered THEN ', interval ''30 days''' ELSE '' END)
	USING p_scope, n, kind, wide, first;
	GET DIAGNOSTICS c = ROW_COUNT;
	RETURN c;
END $$;

/* Row 11: sweep everything that is due, one committed batch at a time, as the worker does. */
CREATE PROCEDURE bench.sweep_all(INOUT swept bigint DEFAULT 0, INOUT calls integer DEFAULT 0)
LANGUAGE plpgsql AS $$
DECLARE
	b	integer := coalesce(nullif(current_setting('idempotency.sweep_batch', true), '')::integer, 1000);
	e	bigint;
	r	bigint;
BEGIN
	LOOP
		SELECT s.expired, s.reset INTO e, r FROM idempotency.idem_sweep(b) s;
		swept := swept + e + r;
		calls := calls + 1;
		COMMIT;
		EXIT WHEN e < b AND r < b;
	END LOOP;
END $$;

/*
 * Row 11: let the sweeper catch up with everything that is due (sweep_at <=
 * now()), calling idem_sweep until nothing is due or max_seconds pass,
 * whatever each call returns.  Measures the sweeper's deferred work (a
 * finished key whose sweep_at is still its lease end gets rescheduled).
 */
CREATE PROCEDURE bench.sweep_drain(max_seconds integer, INOUT calls integer DEFAULT 0,
								   INOUT due_left bigint DEFAULT 0)
LANGUAGE plpgsql AS $$
DECLARE
	stop	timestamptz := clock_timestamp() + make_interval(secs => max_seconds);
	b		integer := coalesce(nullif(current_setting('idempotency.sweep_batch', true), '')::integer, 1000);
BEGIN
	LOOP
		EXIT WHEN NOT EXISTS (SELECT 1 FROM idempotency.keys WHERE sweep_at <= clock_timestamp());
		EXIT WHEN clock_timestamp() > stop;
		PERFORM idempotency.idem_sweep(b);
		calls := calls + 1;
		COMMIT;
	END LOOP;
	SELECT count(*) INTO due_left FROM idempotency.keys WHERE sweep_at <= clock_timestamp();
END $$;
