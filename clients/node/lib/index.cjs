'use strict';
/*
 * pg-idempotency: idempotency keys for node-postgres on top of the idempotency
 * PostgreSQL extension.  The database holds every key's state; this module maps
 * the extension's four claim outcomes onto jobs (idempotent(), idempotentJob()) and onto HTTP
 * (an Express middleware and a Fastify plugin):
 *
 *   claimed      run the work, keep the lease alive, then idem_finish or idem_release
 *   replay       the stored result, without running the work
 *   in_progress  someone else holds the key: 409 + Retry-After / InProgressError
 *   mismatch     same key, different request: 422 / MismatchError
 *
 * Every call is one autocommit statement on whatever pool connection is free
 * (no session state spans claim and finish), so it works through PgBouncer in
 * transaction pooling mode; the transactional HTTP mode holds one connection
 * for its BEGIN ... COMMIT, as any transaction does, and a session-bound job
 * (sessionBound) holds the connection of its claim until it settles.
 *
 * Recovery points: the attempt's checkpoint(phase, data) records a completed
 * step with idem_checkpoint; an attempt that takes the key over gets it back
 * as phase and phaseData, and resumes after that step.
 */

const { createHash } = require('node:crypto');
const { Transform } = require('node:stream');
const { AsyncLocalStorage } = require('node:async_hooks');

const MAX_KEY_LENGTH = 255;
const DEFAULT_LEASE = 30;            /* seconds */
const DEFAULT_RETENTION = 86400;     /* seconds: 24 h */
const DEFAULT_PROBLEM_BASE = 'urn:idempotency:problem:';
const DEFAULT_STORE_HEADERS = ['content-type', 'content-encoding', 'content-language',
	'location', 'etag', 'last-modified'];
/* how a response is framed on one connection: never stored, never replayed */
const FRAMING_HEADERS = new Set(['transfer-encoding', 'content-length', 'connection', 'keep-alive',
	'upgrade', 'te', 'trailer', 'proxy-connection']);
/* headers that describe a body: not kept for a response stored without it */
const BODY_HEADERS = new Set(['content-type', 'content-encoding', 'content-language']);
const DEFAULT_RETRY_AFTER_MAX = 5;          /* seconds */
const DEFAULT_MAX_BODY_SIZE = 1024 * 1024;  /* bytes */
const DEFAULT_HANDLER_TIMEOUT = 300;        /* seconds */
/* the server's default idempotency.max_response_size, when the setting cannot be read */
const DEFAULT_MAX_RESPONSE_SIZE = 1024 * 1024;
const CLIENT_VERSION = '1.4';
/*
 * Every statement this client always sends (idem_claim, idem_finish,
 * idem_extend, idem_release, idem_lookup with the named arguments used
 * here) exists since extension 1.0; checkpoint() and sessionBound need 1.4
 * and say so through PostgreSQL's 42883 when they are used on an older one.
 */
const MIN_EXTENSION_VERSION = '1.0';
/* recovery points and session-bound claims came with 1.4 */
const RECOVERY_EXTENSION_VERSION = '1.4';

/* SQLSTATEs of the extension this module reacts to */
const SQLSTATE = {
	noSuchKey: 'P0002',
	finishedByOther: '55000',
	deadToken: '55006',
	keyBusy: '55P03',
	deadlock: '40P01',
	serialization: '40001',
	readOnly: '25006',
	tooLarge: '54000',
	aborted: '25P02',
};

/*
 * What makes the store unavailable for a moment (a retry helps): a lost or
 * refused connection, a server shutting down or starting, too many
 * connections, a busy key, a serialization failure or deadlock, a read-only
 * server after a failover, a cancelled statement.  Anything else while
 * claiming is a misconfiguration a retry does not fix.
 */
const UNAVAILABLE_SQLSTATES = new Set(['57P01', '57P02', '57P03', '53300', '55P03', '40001',
	'40P01', '25006', '57014']);

/*
 * Results come back as jsonb text and are parsed here, so a pool whose jsonb
 * type parser was replaced still works, and a stored JSON body is replayed as
 * the exact text PostgreSQL keeps (no JavaScript number rounding).
 *
 * phase and phase_data (the checkpoint a takeover resumes from) are read
 * through to_jsonb, so that the statement also runs on extension versions
 * before 1.4, which have neither column (both read as NULL there); only a
 * takeover can carry them, so no other outcome pays for the conversion.
 * session_bound is named only when it is true, for the same reason.
 */
const claimSql = (sessionBound) => `
SELECT c.outcome, c.token::text AS token, c.attempt, c.status, c.response_code,
       (c.response_body -> 'headers')::text AS headers,
       (c.response_body -> 'json')::text AS json,
       c.response_body ->> 'base64' AS base64,
       (c.response_body -> 'error')::text AS error,
       c.retry_after,
       c.response_body ->> 'omitted' AS omitted,
       CASE WHEN c.outcome = 'claimed' AND c.attempt > 1
            THEN pg_catalog.to_jsonb(c) ->> 'phase' END AS phase,
       CASE WHEN c.outcome = 'claimed' AND c.attempt > 1
            THEN (pg_catalog.to_jsonb(c) -> 'phase_data')::text END AS phase_data
  FROM idempotency.idem_claim(key => $1, request => $2::jsonb, scope => $3,
                              lease => pg_catalog.make_interval(secs => $4::float8),
                              retention => pg_catalog.make_interval(secs => $5::float8),
                              wait => pg_catalog.make_interval(secs => $6::float8)${
	sessionBound ? ',\n                              session_bound => true' : ''}) AS c`;
const CLAIM_SQL = claimSql(false);
const SESSION_BOUND_CLAIM_SQL = claimSql(true);

const CHECKPOINT_SQL = `
SELECT idempotency.idem_checkpoint(key => $1, token => $2::bigint, phase => $3,
                                   data => $4::jsonb, scope => $5)`;

const FINISH_SQL = `
SELECT (pg_catalog.date_part('epoch', f.expires_at) * 1000)::float8 AS expires_ms,
       ($4::jsonb -> 'json')::text AS json
  FROM idempotency.idem_finish(key => $1, token => $2::bigint, response_code => $3::int,
                               response_body => $4::jsonb, scope => $5, status => $6,
                               retention => pg_catalog.make_interval(secs => $7::float8))
       AS f(expires_at)`;

/*
 * The HTTP finish: $8 is the JSON body text as the handler wrote it (null
 * when the body is not stored as JSON).  When jsonb's text of it differs, the
 * handler's ETag named bytes nobody gets, and it is not stored.
 */
const HTTP_FINISH_SQL = `
SELECT (pg_catalog.date_part('epoch', f.expires_at) * 1000)::float8 AS expires_ms,
       ($4::jsonb -> 'json')::text AS json
  FROM idempotency.idem_finish(key => $1, token => $2::bigint, response_code => $3::int,
                               response_body => CASE
                                   WHEN $8::text IS NOT NULL
                                    AND ($4::jsonb -> 'json')::text IS DISTINCT FROM $8::text
                                   THEN $4::jsonb #- '{headers,etag}'
                                   ELSE $4::jsonb END,
                               scope => $5, status => $6,
                               retention => pg_catalog.make_interval(secs => $7::float8))
       AS f(expires_at)`;

/* once per pool: which database, which extension version, which response size limit */
const ENVIRONMENT_SQL = `
SELECT pg_catalog.current_database() AS database,
       (SELECT extversion FROM pg_catalog.pg_extension WHERE extname = 'idempotency') AS version,
       (SELECT setting FROM pg_catalog.pg_settings
         WHERE name = 'idempotency.max_response_size') AS max_response_size,
       (SELECT unit FROM pg_catalog.pg_settings
         WHERE name = 'idempotency.max_response_size') AS max_response_size_unit`;

const EXTEND_SQL = `
SELECT idempotency.idem_extend(key => $1, token => $2::bigint,
                               lease => pg_catalog.make_interval(secs => $3::float8),
                               scope => $4) AS lease_until`;

const RELEASE_SQL = `SELECT idempotency.idem_release(key => $1, token => $2::bigint, scope => $3)`;

/* the stored result itself too: a cache entry needs the expiry of the result it holds */
const LOOKUP_SQL = `
SELECT (pg_catalog.date_part('epoch', l.expires_at) * 1000)::float8 AS expires_ms,
       l.status, l.response_code,
       (l.response_body -> 'headers')::text AS headers,
       (l.response_body -> 'json')::text AS json,
       l.response_body ->> 'base64' AS base64,
       l.response_body ->> 'omitted' AS omitted
  FROM idempotency.idem_lookup(key => $1, scope => $2) AS l`;

/* ------------------------------------------------------------------ errors */

class IdempotencyError extends Error {
	constructor(message, options) {
		super(message, options);
		this.name = new.target.name;
	}
}

/* another attempt holds a live claim on the key */
class InProgressError extends IdempotencyError {
	constructor(key, retryAfter) {
		super(`idempotency key ${JSON.stringify(key)} is in use by another attempt; ` +
			`retry in ${retryAfter} s`);
		this.key = key;
		this.retryAfter = retryAfter;
	}
}

/* the key was used before with a different request payload */
class MismatchError extends IdempotencyError {
	constructor(key) {
		super(`idempotency key ${JSON.stringify(key)} was used with a different request`);
		this.key = key;
	}
}

/* the key's stored result is a failure: the replay of a job that failed for good */
class StoredFailureError extends IdempotencyError {
	constructor(key, stored) {
		super(`idempotency key ${JSON.stringify(key)} holds a stored failure: ` +
			`${stored?.name ?? 'Error'}: ${stored?.message ?? ''}`);
		this.key = key;
		this.stored = { name: String(stored?.name ?? 'Error'), message: String(stored?.message ?? '') };
	}
}

/*
 * This attempt no longer owns the key: its lease ran out and another attempt
 * took the key over (or it was settled or removed meanwhile).  Its result was
 * not stored.
 */
class KeyLostError extends IdempotencyError {
	constructor(key, options) {
		super(`idempotency key ${JSON.stringify(key)} was lost: another attempt took it ` +
			'over after the lease ran out; this result was not stored', options);
		this.key = key;
	}
}

/*
 * The idempotency store cannot work as configured (no extension, an old
 * one, no permission, a closed pool): retrying does not help, the message
 * says what to fix.
 */
class MisconfiguredError extends IdempotencyError {}

/* ----------------------------------------------------------------- helpers */

function isUnavailable(err) {
	const code = err?.code;
	if (typeof err?.severity === 'string' && typeof code === 'string')    /* a server error: SQLSTATE */
		return code.startsWith('08') || UNAVAILABLE_SQLSTATES.has(code);
	if (typeof code === 'string')                       /* a socket error: ECONNREFUSED, ETIMEDOUT, ... */
		return code !== 'ENOTFOUND';
	/* pg's own errors carry no code: a closed pool is a mistake, a lost connection is not */
	return !/after calling end on the pool|Client was closed and is not queryable/i.test(String(err?.message));
}

/* the database the pool connects to, as far as its options tell */
function knownDatabase(pool) {
	return pool?.options?.database ?? pool?.database ?? process.env.PGDATABASE ?? null;
}

function notInstalled(database) {
	return `The idempotency extension is not installed in database ${JSON.stringify(database ?? '?')}: ` +
		'run CREATE EXTENSION idempotency.';
}

/* what a misconfiguration error means and how to fix it */
function misconfigurationDetail(err, database) {
	const code = err?.code;
	const message = String(err?.message ?? err);
	if (code === '42883' || code === '3F000')
		return notInstalled(database);
	if (code === '42501')
		return `The database role may not use the idempotency extension (${message}): ` +
			'GRANT USAGE ON SCHEMA idempotency TO the role of the pool.';
	if (typeof code === 'string' && code.startsWith('28'))
		return `PostgreSQL refused the pool's login (${code}: ${message}): check the user and password of the pool.`;
	if (code === '3D000')
		return `The pool's database does not exist (${message}): check the database setting of the pool.`;
	if (code === 'ENOTFOUND')
		return `The database host was not found (${message}): check the host setting of the pool.`;
	if (/after calling end on the pool|Client was closed/i.test(message))
		return `The pg pool given to pg-idempotency is closed (${message}): pass a pool that stays open while the app serves requests.`;
	return `Claiming the key failed with ${code ?? 'an error'} (${message}); retrying does not help: ` +
		'check the database and the idempotency extension.';
}

function versionParts(version) {
	return String(version).split('.').map((n) => Number.parseInt(n, 10) || 0);
}

function versionBefore(a, b) {
	const x = versionParts(a);
	const y = versionParts(b);
	for (let i = 0; i < Math.max(x.length, y.length); i++)
		if ((x[i] ?? 0) !== (y[i] ?? 0))
			return (x[i] ?? 0) < (y[i] ?? 0);
	return false;
}

/* PostgreSQL's memory units (guc.c): powers of 1024, case-sensitive */
const MEMORY_UNITS = { B: 1, kB: 1024, MB: 1024 ** 2, GB: 1024 ** 3, TB: 1024 ** 4 };

/*
 * A memory setting of pg_settings in bytes.  With the library loaded in the
 * session, `setting` is a number of `unit` (B, kB, 8kB, ...); before it is
 * loaded, the variable is a placeholder whose `setting` is the text as
 * written ("2MB", "512 kB") and `unit` is null.  Anything else is not a
 * size this client can trust: the fallback.
 */
function parseMemorySetting(setting, unit, fallback) {
	if (setting === null || setting === undefined)
		return fallback;
	const m = /^\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*$/.exec(String(setting));
	if (m === null)
		return fallback;
	let factor;
	if (m[2] !== '') {
		factor = MEMORY_UNITS[m[2]];
	} else if (unit === null || unit === undefined || unit === '') {
		factor = 1;
	} else {
		const u = /^(\d*)([A-Za-z]+)$/.exec(String(unit));
		factor = u === null || MEMORY_UNITS[u[2]] === undefined ? undefined
			: (u[1] === '' ? 1 : Number(u[1])) * MEMORY_UNITS[u[2]];
	}
	if (factor === undefined)
		return fallback;
	const bytes = Math.round(Number(m[1]) * factor);
	return Number.isSafeInteger(bytes) ? bytes : fallback;
}

/*
 * Read once per pool, at its first claim: the database's name, the
 * extension's version (absent or too old: MisconfiguredError) and
 * idempotency.max_response_size.  A failed read is not kept, so the next
 * claim reads again (after CREATE EXTENSION, or once the server is back).
 */
const ENVIRONMENTS = new WeakMap();

/* The extension at <need> or later, else a MisconfiguredError naming the fix. */
function requireVersion({ database, version }, need, what) {
	if (versionBefore(version, need))
		throw new MisconfiguredError(`pg-idempotency ${CLIENT_VERSION}${what} needs the idempotency ` +
			`extension ${need} or later; database ${JSON.stringify(database)} ` +
			`has ${version}: run ALTER EXTENSION idempotency UPDATE.`);
}

function poolInfo(pool, log) {
	let pending = ENVIRONMENTS.get(pool);
	if (pending === undefined) {
		pending = (async () => {
			const { rows } = await pool.query(ENVIRONMENT_SQL);
			const { database, version, max_response_size: max, max_response_size_unit: unit } = rows[0];
			if (version === null || version === undefined)
				throw new MisconfiguredError(notInstalled(database));
			requireVersion({ database, version }, MIN_EXTENSION_VERSION, '');
			const maxResponseSize = parseMemorySetting(max, unit, DEFAULT_MAX_RESPONSE_SIZE);
			log(`pg-idempotency: database ${JSON.stringify(database)}, idempotency extension ${version}; ` +
				`responses over ${maxResponseSize} bytes are stored without their body`);
			return { database, version, maxResponseSize };
		})();
		ENVIRONMENTS.set(pool, pending);
		pending.catch(() => {
			if (ENVIRONMENTS.get(pool) === pending)
				ENVIRONMENTS.delete(pool);
		});
	}
	return pending;
}

function isLostKey(err) {
	return err?.code === SQLSTATE.deadToken || err?.code === SQLSTATE.finishedByOther ||
		err?.code === SQLSTATE.noSuchKey;
}

/* worth another try of the same statement: a busy key, a dropped connection */
function isTransient(err) {
	const code = err?.code;
	return code === SQLSTATE.keyBusy || code === SQLSTATE.serialization ||
		code === SQLSTATE.deadlock || code === undefined ||
		/^(ECONN|EPIPE|ETIMEDOUT)/.test(String(code));
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/*
 * Run a token statement (finish, extend, release) again after a transient
 * failure.  Repeating them is safe: a finish repeated with its own token
 * returns the same expiry.  An error after a retry is marked `retried`, so a
 * release can take "absent" as its own earlier success whose reply was lost.
 */
async function queryWithRetry(db, sql, params) {
	for (let attempt = 0; ; attempt++) {
		try {
			return await db.query(sql, params);
		} catch (err) {
			if (attempt >= 4 || !isTransient(err)) {
				if (attempt > 0)
					err.retried = true;
				throw err;
			}
			await sleep(50 * 2 ** attempt);
		}
	}
}

function seconds(value, name, fallback) {
	if (value === undefined || value === null)
		return fallback;
	if (typeof value !== 'number' || !Number.isFinite(value) || value < 0)
		throw new TypeError(`${name} must be a number of seconds, got ${String(value)}`);
	return value;
}

function positiveSeconds(value, name, fallback) {
	const s = seconds(value, name, fallback);
	if (s <= 0)
		throw new TypeError(`${name} must be more than 0 seconds`);
	return s;
}

function toJsonText(value, what) {
	const text = JSON.stringify(value);
	if (text === undefined)
		throw new TypeError(`${what} cannot be stored as JSON`);
	return text;
}

/*
 * Heartbeat: idem_extend every lease / 3 while the work runs, so a slow but
 * alive owner keeps its key while a crashed one loses it one lease after its
 * last beat.  stop() waits for a beat in flight, so a beat never races the
 * finish (an extend and a finish of the same key at once answer 55P03).
 */
function startHeartbeat(db, { key, token, scope, lease, onLost, onBeat, log }) {
	const every = Math.max(10, Math.floor((lease * 1000) / 3));
	let stopped = false;
	let lost = false;
	let timer = null;
	let inflight = Promise.resolve();
	const beat = () => {
		inflight = queryWithRetry(db, EXTEND_SQL, [key, token, lease, scope])
			.then(() => onBeat?.(), (err) => {
				if (isLostKey(err)) {
					lost = true;
					onLost(err);
				} else {
					log('pg-idempotency: heartbeat failed; trying again at the next beat', err);
				}
			})
			.finally(() => {
				if (!stopped && !lost)
					timer = setTimeout(beat, every);
			});
	};
	timer = setTimeout(beat, every);
	return {
		get lost() { return lost; },
		async stop() {
			stopped = true;
			clearTimeout(timer);
			await inflight;
		},
	};
}

const defaultLog = (message, err) => console.error(message, err ?? '');

/* a takeover's checkpoint data (jsonb text), or null */
function phaseDataOf(claim) {
	return claim.phase_data === null || claim.phase_data === undefined
		? null : JSON.parse(claim.phase_data);
}

/*
 * The checkpoint(phase, data, { client }) of one attempt.  On `client` (a
 * transaction of the caller's: the step's writes and its checkpoint commit
 * together, or neither), else on `defaultClient` (the transactional HTTP
 * mode's transaction), else on `db` on its own, tried again after a transient
 * failure like the other token statements (recording the same checkpoint
 * twice is harmless).  A lost key calls onLost and throws KeyLostError.
 */
function makeCheckpoint(db, { key, token, scope, defaultClient, onLost, info }) {
	return async function checkpoint(phase, data, options) {
		if (typeof phase !== 'string')
			throw new TypeError('checkpoint(phase, data) needs the name of the completed step (a string)');
		requireVersion(info, RECOVERY_EXTENSION_VERSION, ' (checkpoint())');
		const params = [key, token, phase,
			data === undefined || data === null ? null : toJsonText(data, 'the checkpoint data'), scope];
		const client = options?.client ?? defaultClient;
		try {
			if (client)
				await client.query(CHECKPOINT_SQL, params);
			else
				await queryWithRetry(db, CHECKPOINT_SQL, params);
		} catch (err) {
			if (isLostKey(err)) {
				const lost = new KeyLostError(key, { cause: err });
				onLost(lost);
				throw lost;
			}
			throw err;
		}
	};
}

/*
 * A pg.Pool (or a wrapper of one): connect() hands out a client of its own.
 * A pg.Client has connect() too, but it connects that very client.
 */
function isPool(db) {
	return typeof db.connect === 'function' && !('processID' in db);
}

/* ------------------------------------------------------------ jobs/consumers */

/*
 * idempotent(pool, options, fn): run fn at most once per (scope, key) until
 * the key's retention passes, and hand every later call the stored value.
 */
async function idempotent(pool, options, fn) {
	if (!pool || typeof pool.query !== 'function')
		throw new TypeError('idempotent(pool, options, fn) needs a pg Pool (or anything with query())');
	if (typeof fn !== 'function')
		throw new TypeError('idempotent(pool, options, fn) needs a function');
	const key = options?.key;
	if (typeof key !== 'string' || key.length === 0)
		throw new TypeError('options.key must be a non-empty string');
	const scope = options.scope ?? '';
	const lease = positiveSeconds(options.lease, 'lease', DEFAULT_LEASE);
	const retention = positiveSeconds(options.retention, 'retention', DEFAULT_RETENTION);
	const wait = seconds(options.wait, 'wait', 0);
	const retryable = options.retryable ?? (() => true);
	const log = options.log ?? defaultLog;
	const request = options.request === undefined ? null : toJsonText(options.request, 'request');
	if (options.sessionBound !== undefined && typeof options.sessionBound !== 'boolean')
		throw new TypeError(`options.sessionBound must be a boolean, got ${String(options.sessionBound)}`);
	const sessionBound = options.sessionBound === true;
	const params = [key, request, scope, lease, retention, wait];
	const info = await poolInfo(pool, log);
	if (sessionBound)
		requireVersion(info, RECOVERY_EXTENSION_VERSION, ' (sessionBound)');

	/*
	 * A session-bound claim through a pool runs on a client held until the
	 * attempt settles: the key is bound to that session, which then lives as
	 * long as the attempt.  Back in the pool, an idle client may be closed
	 * (idleTimeoutMillis) and the key freed while the work still runs.
	 */
	let held = null;
	let heldError;
	let claim;
	if (sessionBound && isPool(pool)) {
		held = await pool.connect();
		const onError = (err) => {
			heldError = err;
			log('pg-idempotency: the connection of a session-bound claim failed; ' +
				'the key is free for another attempt', err);
		};
		held.on?.('error', onError);
		const giveBack = () => {
			held.off?.('error', onError);
			held.release(heldError);
			held = null;
		};
		try {
			claim = (await held.query(SESSION_BOUND_CLAIM_SQL, params)).rows[0];
		} catch (err) {
			/* a connection error (no SQLSTATE) retires the client; a refused claim does not */
			if (err?.code === undefined)
				heldError = err;
			giveBack();
			throw err;
		}
		if (claim.outcome === 'claimed') {
			try {
				return await runClaimed(pool, claim, { key, scope, lease, retention, retryable, log, info }, fn);
			} finally {
				giveBack();
			}
		}
		giveBack();
	} else {
		claim = (await pool.query(sessionBound ? SESSION_BOUND_CLAIM_SQL : CLAIM_SQL, params)).rows[0];
	}
	switch (claim.outcome) {
		case 'replay':
			if (claim.status === 'failed')
				throw new StoredFailureError(key, claim.error === null ? null : JSON.parse(claim.error));
			return { replayed: true, value: storedValue(claim), attempt: null, token: null };
		case 'in_progress':
			throw new InProgressError(key, claim.retry_after ?? 1);
		case 'mismatch':
			throw new MismatchError(key);
		case 'claimed':
			return runClaimed(pool, claim, { key, scope, lease, retention, retryable, log, info }, fn);
		default:
			throw new IdempotencyError(`unexpected claim outcome ${claim.outcome}`);
	}
}

/* run fn for a claimed key, keep its lease alive, then store its result or give the key back */
async function runClaimed(pool, claim, { key, scope, lease, retention, retryable, log, info }, fn) {
	const token = claim.token;
	const attempt = claim.attempt;
	const controller = new AbortController();
	let lost = false;
	const onLost = (err) => {
		lost = true;
		controller.abort(err);
	};
	const heartbeat = startHeartbeat(pool, {
		key, token, scope, lease, log,
		onLost: (err) => onLost(new KeyLostError(key, { cause: err })),
	});
	const checkpoint = makeCheckpoint(pool, { key, token, scope, onLost, info });

	let value;
	try {
		value = await fn({
			key, scope, token, attempt, signal: controller.signal,
			phase: claim.phase ?? null, phaseData: phaseDataOf(claim), checkpoint,
		});
	} catch (err) {
		await heartbeat.stop();
		if (lost)
			throw err instanceof KeyLostError ? err : new KeyLostError(key, { cause: err });
		if (retryable(err)) {
			await releaseOrLost(pool, key, token, scope, err);
			throw err;
		}
		const envelope = JSON.stringify({
			v: 1,
			error: { name: String(err?.name ?? 'Error'), message: String(err?.message ?? err) },
		});
		await finishOrLost(pool, [key, token, null, envelope, scope, 'failed', retention], err);
		throw err;
	}
	await heartbeat.stop();
	if (lost)
		throw new KeyLostError(key);

	let envelope;
	try {
		/* no value is JSON null, as the Python library stores None */
		envelope = `{"v":1,"json":${value === undefined ? 'null' : toJsonText(value, 'the return value')}}`;
	} catch (err) {
		await releaseOrLost(pool, key, token, scope, err);
		throw err;
	}
	await finishOrLost(pool, [key, token, null, envelope, scope, 'succeeded', retention]);
	return { replayed: false, value, attempt, token };
}

const jobs = new AsyncLocalStorage();

/*
 * idempotentJob(pool, options, fn): fn wrapped so that each call runs it at
 * most once per key, the key (and the request and scope, when they are
 * functions) computed from the call's arguments.  The scope defaults to the
 * function's name: two jobs whose arguments give the same key (an order id)
 * are still two operations.  Inside fn, currentJob() is the running attempt.
 */
function idempotentJob(pool, options, fn) {
	if (!pool || typeof pool.query !== 'function')
		throw new TypeError('idempotentJob(pool, options, fn) needs a pg Pool (or anything with query())');
	if (typeof fn !== 'function')
		throw new TypeError('idempotentJob(pool, options, fn) needs the job function');
	const { key, request, scope = fn.name, ...rest } = options ?? {};
	if (typeof key !== 'function')
		throw new TypeError('idempotentJob needs options.key: a function of the job\'s arguments returning its key');
	if (request !== undefined && typeof request !== 'function')
		throw new TypeError('options.request of idempotentJob must be a function of the job\'s arguments');
	if (scope === '' && options?.scope === undefined)
		throw new TypeError('idempotentJob: the job function has no name, and its name is the default ' +
			'scope: pass options.scope (a string, or a function of the job\'s arguments)');
	if (typeof scope !== 'string' && typeof scope !== 'function')
		throw new TypeError('options.scope of idempotentJob must be a string or a function of the job\'s arguments');
	const job = async function (...args) {
		const result = await idempotent(pool, {
			...rest,
			key: await key(...args),
			request: request === undefined ? undefined : await request(...args),
			scope: typeof scope === 'function' ? await scope(...args) : scope,
		}, (attempt) => jobs.run(attempt, () => fn.apply(this, args)));
		return result.value;
	};
	Object.defineProperty(job, 'name', { value: fn.name });
	return job;
}

/* the attempt of the idempotentJob running in this async context, or undefined */
function currentJob() {
	return jobs.getStore();
}

/* a job's stored value: json, the bytes of base64, or undefined for none (an older {"v":1}) */
function storedValue(claim) {
	if (claim.json !== null)
		return JSON.parse(claim.json);
	if (claim.base64 !== null)
		return Buffer.from(claim.base64, 'base64');
	return undefined;
}

async function releaseOrLost(db, key, token, scope, cause) {
	try {
		await queryWithRetry(db, RELEASE_SQL, [key, token, scope]);
	} catch (err) {
		/* absent after a retry: the first try released it and its reply was lost */
		if (err.code === SQLSTATE.noSuchKey && err.retried)
			return;
		if (isLostKey(err))
			throw new KeyLostError(key, { cause: cause ?? err });
		throw err;
	}
}

async function finishOrLost(db, params, cause, sql = FINISH_SQL) {
	try {
		return (await queryWithRetry(db, sql, params)).rows[0];
	} catch (err) {
		if (isLostKey(err))
			throw new KeyLostError(params[0], { cause: cause ?? err });
		throw err;
	}
}

/* ------------------------------------------------- the Idempotency-Key header */

/*
 * A bare key: the characters of an RFC 8941 sf-token (tchar / ":" / "/").
 * A strict sf-token also starts with a letter or "*"; a bare UUID that starts
 * with a digit is accepted too, because many clients send their keys so and
 * the value is unambiguous.
 */
const TOKEN_RE = /^[!#$%&'*+\-.^_`|~0-9A-Za-z:/]+/;

/*
 * Parse the Idempotency-Key field: an RFC 8941 sf-string, or a bare sf-token.
 * `values` is one string per field line (Node's req.headersDistinct).
 * Returns { key } | { missing: true } | { problem: slug, detail }.
 */
function parseIdempotencyKey(values) {
	if (values === undefined || values === null)
		return { missing: true };
	const lines = Array.isArray(values) ? values : [values];
	if (lines.length === 0)
		return { missing: true };
	if (lines.length > 1)
		return repeated();
	const input = lines[0].replace(/^ +| +$/g, '');
	let key;
	let rest;
	if (input.startsWith('"')) {
		let out = '';
		let i = 1;
		for (; i < input.length; i++) {
			const c = input[i];
			const code = input.charCodeAt(i);
			if (c === '\\') {
				const next = input[i + 1];
				if (next !== '"' && next !== '\\')
					return malformed('A backslash in the quoted Idempotency-Key may only escape " or \\.');
				out += next;
				i++;
			} else if (c === '"') {
				break;
			} else if (code < 0x20 || code > 0x7e) {
				return malformed('The Idempotency-Key may only contain printable ASCII characters.');
			} else {
				out += c;
			}
		}
		if (i >= input.length)
			return malformed('The quoted Idempotency-Key has no closing quote.');
		key = out;
		rest = input.slice(i + 1);
	} else {
		const m = TOKEN_RE.exec(input);
		if (m === null) {
			if (input.length === 0)
				return malformed('The Idempotency-Key header is empty.');
			return malformed('The Idempotency-Key must be a quoted string, e.g. ' +
				'Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324" (a bare value may ' +
				'hold only token characters).');
		}
		key = m[0];
		rest = input.slice(key.length);
	}
	const after = rest.replace(/^[ \t]+/, '');
	if (after.startsWith(','))
		return repeated();
	if (after.length > 0)
		return malformed(after.startsWith(';')
			? 'The Idempotency-Key takes no parameters.'
			: 'The Idempotency-Key holds characters that are not allowed.');
	if (key.length === 0)
		return malformed('The Idempotency-Key is empty.');
	if (key.length > MAX_KEY_LENGTH)
		return {
			problem: 'idempotency-key-too-long',
			detail: `The Idempotency-Key is ${key.length} characters long; ` +
				`the limit is ${MAX_KEY_LENGTH} characters.`,
		};
	return { key };
}

function malformed(detail) {
	return { problem: 'idempotency-key-malformed', detail };
}

function repeated() {
	return {
		problem: 'idempotency-key-repeated',
		detail: 'Send exactly one Idempotency-Key header holding one key.',
	};
}

/* every problem the HTTP layer answers with: its status and title, by slug */
const PROBLEMS = Object.freeze(Object.fromEntries(Object.entries({
	'idempotency-key-missing': [400, 'Idempotency-Key header missing'],
	'idempotency-key-malformed': [400, 'Idempotency-Key header malformed'],
	'idempotency-key-repeated': [400, 'Idempotency-Key header repeated'],
	'idempotency-key-too-long': [400, 'Idempotency-Key too long'],
	'idempotency-key-in-use': [409, 'A request with this Idempotency-Key is in progress'],
	'idempotency-key-reused': [422, 'Idempotency-Key reused with a different request'],
	'idempotency-key-lost': [409, 'Idempotency-Key lost to a newer attempt'],
	'idempotency-request-too-large': [413, 'Request body too large'],
	'idempotency-misconfigured': [500, 'Idempotency middleware misconfigured'],
	'idempotency-unavailable': [503, 'Idempotency store briefly unavailable'],
	'idempotency-handler-timeout': [504, 'Request handler timed out'],
}).map(([slug, [status, title]]) => [slug, Object.freeze({ status, title })])));

/*
 * A key returned by the key(req) option: the same limits as the header's
 * key, without its quoting rules (the value comes from the application).
 */
function checkCustomKey(value) {
	if (typeof value !== 'string')
		throw new TypeError(`key(req) must return a string, or null when the request has none; got ${typeof value}`);
	if (value.length === 0)
		return malformed('The idempotency key of this request is empty.');
	if (/[\u0000-\u001f\u007f]/.test(value))
		return malformed('The idempotency key of this request holds control characters.');
	if (value.length > MAX_KEY_LENGTH)
		return {
			problem: 'idempotency-key-too-long',
			detail: `The idempotency key is ${value.length} characters long; ` +
				`the limit is ${MAX_KEY_LENGTH} characters.`,
		};
	return { key: value };
}

/* -------------------------------------------------------------- HTTP engine */

/*
 * What a status means for the key: a 2xx or 3xx is the operation's outcome
 * and is kept; a 4xx says the request itself is wrong, so a retry of the same
 * request gets the same answer and it is kept too.  A 5xx says nothing about
 * the request (the server failed, perhaps before doing anything), so the key
 * is released and a retry runs the request again, unless the application
 * knows its 5xx are final (storeServerErrors).  408, 409, 425 and 429 say
 * "not now", which a retry may change: released.  A 304 answers the
 * conditional request of one client and means nothing to another: released.
 */
function defaultStorePolicy(status, { storeServerErrors = false } = {}) {
	if (status >= 500)
		return storeServerErrors ? 'failed' : 'release';
	if (status === 304)
		return 'release';
	if (status === 408 || status === 409 || status === 425 || status === 429)
		return 'release';
	if (status >= 400)
		return 'failed';
	return 'succeeded';
}

function isJsonType(contentType) {
	if (typeof contentType !== 'string')
		return false;
	const media = contentType.split(';')[0].trim().toLowerCase();
	return media === 'application/json' || /^[a-z0-9!#$&^_.+-]+\/[a-z0-9!#$&^_.+-]+\+json$/.test(media);
}

const utf8 = new TextDecoder('utf-8', { fatal: true, ignoreBOM: true });

/* jsonb refuses \u0000 and unpaired surrogate escapes */
const JSONB_REFUSES = /\\u(0000|d[89a-f][0-9a-f]{2})/i;

/* the body as JSON text jsonb accepts as it is, or null */
function jsonText(body) {
	try {
		const text = utf8.decode(body);
		JSON.parse(text);
		return JSONB_REFUSES.test(text) ? null : text;
	} catch {
		return null;
	}
}

/*
 * The envelope's body member: "json" when the body is JSON that jsonb keeps
 * as it is, "base64" otherwise.
 */
function bodyMember(contentType, body) {
	if (body.length === 0)
		return null;
	if (isJsonType(contentType)) {
		const text = jsonText(body);
		if (text !== null)
			return { json: text };
	}
	return { base64: body.toString('base64') };
}

function headerValue(value) {
	if (Array.isArray(value))
		return value.map(String).join(', ');
	return String(value);
}

/* lower-case names; the framing headers go: the body is sent with its own Content-Length */
function normaliseHeaders(headers) {
	const out = {};
	for (const [name, value] of Object.entries(headers ?? {})) {
		const lower = name.toLowerCase();
		if (value !== undefined && value !== null && !FRAMING_HEADERS.has(lower))
			out[lower] = value;
	}
	return out;
}

/* a bounded LRU of finished results, keyed by scope and key */
function createCache(max) {
	const entries = new Map();
	return {
		get(id, fingerprint) {
			const entry = entries.get(id);
			if (entry === undefined)
				return null;
			if (entry.expiresMs <= Date.now()) {
				entries.delete(id);
				return null;
			}
			if (entry.fingerprint !== fingerprint)
				return null;
			entries.delete(id);
			entries.set(id, entry);
			return entry.response;
		},
		set(id, fingerprint, response, expiresMs) {
			if (!(expiresMs > Date.now()))
				return;
			entries.delete(id);
			entries.set(id, { fingerprint, response, expiresMs });
			while (entries.size > max)
				entries.delete(entries.keys().next().value);
		},
		get size() { return entries.size; },
	};
}

/*
 * maxBodySize: bytes; null or 0 lifts the limit (Infinity here), absent is
 * the default.  A bad value fails at construction, not at the first request.
 */
function bodyLimit(value) {
	if (value === undefined)
		return DEFAULT_MAX_BODY_SIZE;
	if (value === null || value === 0)
		return Infinity;
	if (!Number.isSafeInteger(value) || value < 0)
		throw new TypeError(`maxBodySize must be a whole number of bytes (0 or null: no limit), got ${String(value)}`);
	return value;
}

/* the request body was over maxBodySize: what a rawBody() reader returns then */
const TOO_LARGE = Symbol('pg-idempotency.tooLarge');

/*
 * The framework-free part of the HTTP behaviour.  A framework adapter calls
 * begin() with the request's method, path, header lines, a reader of the raw
 * body and onTimeout(response); the answer is one of:
 *   { action: 'pass' }                       not covered: run the route as usual
 *   { action: 'respond', response }          answer now (4xx, 409, 422, 5xx, a replay)
 *   { action: 'run', context, complete, abandon }
 *       run the handler; hand its response to complete(), which stores it per
 *       the status policy and resolves to the response to send, or to null
 *       when onTimeout already answered the client.
 */
function createEngine(options) {
	const pool = options?.pool;
	if (!pool || typeof pool.query !== 'function')
		throw new TypeError('pg-idempotency needs options.pool: a pg Pool');
	const methods = new Set((options.methods ?? ['POST', 'PATCH']).map((m) => m.toUpperCase()));
	const required = options.required ?? true;
	const scopeOf = options.scope ?? (() => '');
	const keyOf = options.key ?? null;
	if (keyOf !== null && typeof keyOf !== 'function')
		throw new TypeError('options.key must be a function key(req) returning the key, or null when the request has none');
	const fingerprintOf = options.fingerprint ?? null;
	const lease = positiveSeconds(options.lease, 'lease', DEFAULT_LEASE);
	const retention = positiveSeconds(options.retention, 'retention', DEFAULT_RETENTION);
	const retryAfterMax = Math.max(1, Math.floor(positiveSeconds(options.retryAfterMax, 'retryAfterMax', DEFAULT_RETRY_AFTER_MAX)));
	const handlerTimeout = options.handlerTimeout === 0 || options.handlerTimeout === null ? 0
		: positiveSeconds(options.handlerTimeout, 'handlerTimeout', DEFAULT_HANDLER_TIMEOUT);
	const maxBodySize = bodyLimit(options.maxBodySize);
	const canonicalJson = options.canonicalJson ?? false;
	if (typeof canonicalJson !== 'boolean')
		throw new TypeError(`canonicalJson must be a boolean, got ${String(canonicalJson)}`);
	const storeServerErrors = options.storeServerErrors ?? false;
	if (typeof storeServerErrors !== 'boolean')
		throw new TypeError(`storeServerErrors must be a boolean, got ${String(storeServerErrors)}`);
	const failedWrites = options.failedWrites ?? 'commit';
	if (failedWrites !== 'commit' && failedWrites !== 'rollback')
		throw new TypeError(`failedWrites must be 'commit' or 'rollback', got ${String(failedWrites)}`);
	const problemBase = options.problemTypeBase ?? DEFAULT_PROBLEM_BASE;
	const storePolicy = options.storePolicy ?? ((status) => defaultStorePolicy(status, { storeServerErrors }));
	const storeHeaders = [...new Set([...DEFAULT_STORE_HEADERS,
		...(options.storeHeaders ?? []).map((h) => String(h).toLowerCase())])]
		.filter((h) => !FRAMING_HEADERS.has(h));
	/* a response stored without its body keeps no header that describes the body */
	const omittedHeaders = storeHeaders.filter((h) => !BODY_HEADERS.has(h));
	const log = options.log ?? defaultLog;
	const cache = options.cache ? createCache(Math.max(1, options.cache.max ?? 1000)) : null;
	const retentionHeader = String(Math.round(retention));
	const logged = new Set();

	function problem(slug, status, detail, extraHeaders = {}) {
		const body = Buffer.from(JSON.stringify({
			type: problemBase + slug, title: PROBLEMS[slug].title, status, detail,
		}));
		return {
			status,
			headers: {
				'content-type': 'application/problem+json',
				'idempotency-key-retention': retentionHeader,
				...extraHeaders,
			},
			body,
		};
	}

	const lostKey = () => problem('idempotency-key-lost', 409,
		'This attempt took longer than its lease and another attempt with the same ' +
		'Idempotency-Key took over; this result was not stored. Retry to get the stored result.');

	const unavailable = (detail = 'The result could not be recorded. Retry this request with the same Idempotency-Key.') =>
		problem('idempotency-unavailable', 503, detail, { 'retry-after': '1' });

	/* each distinct cause is logged once, not once per request */
	function misconfigured(detail, err) {
		if (!logged.has(detail)) {
			logged.add(detail);
			log(`pg-idempotency: misconfigured: ${detail}`, err);
		}
		return problem('idempotency-misconfigured', 500, detail);
	}

	/* a failed claim (or the check before it) as an answer: 503 when retrying helps, else 500 */
	function claimFailure(err, database) {
		if (err instanceof MisconfiguredError)
			return misconfigured(err.message, undefined);
		if (isUnavailable(err)) {
			log('pg-idempotency: the idempotency store is unavailable', err);
			return unavailable('The idempotency store could not be reached. Retry this request with the same Idempotency-Key.');
		}
		return misconfigured(misconfigurationDetail(err, database), err);
	}

	/* a stored envelope as an HTTP response */
	function replayResponse(row) {
		const headers = normaliseHeaders(row.headers === null ? {} : JSON.parse(row.headers));
		let body = Buffer.alloc(0);
		if (row.json !== null)
			body = Buffer.from(row.json);
		else if (row.base64 !== null)
			body = Buffer.from(row.base64, 'base64');
		const omitted = row.omitted ?? null;
		return {
			status: row.response_code ?? 200,
			headers: {
				...headers,
				'idempotent-replayed': 'true',
				...(omitted === null ? {} : { 'idempotent-body-omitted': String(omitted) }),
				'idempotency-key-retention': retentionHeader,
			},
			body,
		};
	}

	/* the fingerprint sent as jsonb text: built from the raw text, so numbers stay exact */
	function defaultFingerprint(method, path, contentType, body) {
		if (canonicalJson && isJsonType(contentType)) {
			const text = jsonText(body);
			if (text !== null)
				return `{"method":${JSON.stringify(method)},"path":${JSON.stringify(path)},"body":${text}}`;
		}
		return JSON.stringify({
			method, path, body_sha256: createHash('sha256').update(body).digest('hex'),
		});
	}

	async function begin(req, { transactional = false } = {}) {
		if (!methods.has(String(req.method).toUpperCase()))
			return { action: 'pass' };
		let parsed;
		if (keyOf) {
			const value = await keyOf(req.original);
			parsed = value === null || value === undefined ? { missing: true } : checkCustomKey(value);
		} else {
			parsed = parseIdempotencyKey(req.keyLines);
		}
		if (parsed.missing) {
			if (!required)
				return { action: 'pass' };
			return {
				action: 'respond',
				response: problem('idempotency-key-missing', 400,
					`${req.method} ${req.path.split('?')[0]} requires an Idempotency-Key header: ` +
					'a unique string of 1 to 255 characters per operation, sent again ' +
					'with every retry, e.g. Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324".'),
			};
		}
		if (parsed.problem)
			return { action: 'respond', response: problem(parsed.problem, 400, parsed.detail) };

		const tooLarge = () => ({
			action: 'respond',
			response: problem('idempotency-request-too-large', 413,
				`The request body is over ${maxBodySize} bytes, the most this endpoint accepts; ` +
				'the Idempotency-Key was not used.'),
		});
		if (Number(req.contentLength) > maxBodySize)
			return tooLarge();

		const key = parsed.key;
		let requestText;
		if (fingerprintOf) {
			/*
			 * The limit holds here too: a chunked body is read up to limit + 1
			 * bytes (and put back).  A body a parser already read without
			 * keeping its bytes was bounded by that parser.
			 */
			if (maxBodySize !== Infinity) {
				let body = null;
				try {
					body = await req.rawBody(maxBodySize);
				} catch (err) {
					if (!(err instanceof MisconfiguredError))
						throw err;
				}
				if (body === TOO_LARGE)
					return tooLarge();
			}
			requestText = toJsonText(await fingerprintOf(req.original), 'the request fingerprint');
		} else {
			let body;
			try {
				body = await req.rawBody(maxBodySize);
			} catch (err) {
				if (err instanceof MisconfiguredError)
					return { action: 'respond', response: misconfigured(err.message) };
				throw err;
			}
			if (body === TOO_LARGE)
				return tooLarge();
			requestText = defaultFingerprint(String(req.method).toUpperCase(), req.path, req.contentType, body);
		}
		const scope = String((await scopeOf(req.original)) ?? '');
		const cacheId = `${scope}\u0000${key}`;

		if (cache) {
			const hit = cache.get(cacheId, requestText);
			if (hit)
				return { action: 'respond', response: hit, cached: true };
		}

		let client = null;
		let claim;
		let info = null;
		try {
			info = await poolInfo(pool, log);
			if (transactional) {
				client = await pool.connect();
				await client.query('BEGIN');
				claim = (await client.query(CLAIM_SQL,
					[key, requestText, scope, lease, retention, 0])).rows[0];
				/*
				 * The savepoint after the claim: failedWrites 'rollback' returns
				 * to it, and so does a failed outcome whose handler left the
				 * transaction aborted (its writes are lost anyway).
				 */
				if (claim.outcome === 'claimed')
					await client.query('SAVEPOINT idem_handler');
				if (claim.outcome !== 'claimed') {
					await client.query('ROLLBACK');
					client.release();
					client = null;
				}
			} else {
				claim = (await pool.query(CLAIM_SQL,
					[key, requestText, scope, lease, retention, 0])).rows[0];
			}
		} catch (err) {
			if (client)
				await discard(client);
			return { action: 'respond', response: claimFailure(err, info?.database ?? knownDatabase(pool)) };
		}

		switch (claim.outcome) {
			case 'replay': {
				const response = replayResponse(claim);
				if (cache)
					await fillCache(cacheId, requestText, response, claim, key, scope);
				return { action: 'respond', response };
			}
			case 'in_progress': {
				const wait = Math.ceil(Number(claim.retry_after ?? 1));
				const retryAfter = String(Math.min(Math.max(1, Number.isFinite(wait) ? wait : 1), retryAfterMax));
				return {
					action: 'respond',
					response: problem('idempotency-key-in-use', 409,
						'A request with the same Idempotency-Key is still being processed. ' +
						'Retry after the delay in Retry-After to get its result.',
						{ 'retry-after': retryAfter }),
				};
			}
			case 'mismatch':
				return {
					action: 'respond',
					response: problem('idempotency-key-reused', 422,
						'This Idempotency-Key was already used for a different request ' +
						'(method, path or body). Use a new key for a new operation.'),
				};
			case 'claimed':
				break;
			default:
				throw new IdempotencyError(`unexpected claim outcome ${claim.outcome}`);
		}

		const token = claim.token;
		const controller = new AbortController();
		let lost = false;
		const onLost = (err) => {
			lost = true;
			controller.abort(err);
		};
		const context = {
			key, scope, token, attempt: claim.attempt, signal: controller.signal,
			client: client ?? undefined,
			phase: claim.phase ?? null, phaseData: phaseDataOf(claim),
			checkpoint: makeCheckpoint(pool, { key, token, scope, defaultClient: client, onLost, info }),
		};
		/* a transaction's claim is invisible to others until COMMIT: no lease to keep */
		const heartbeat = transactional ? null : startHeartbeat(pool, {
			key, token, scope, lease, log,
			onLost: (err) => onLost(new KeyLostError(key, { cause: err })),
			onBeat: options.onHeartbeat,
		});
		let settled = false;
		let timedOut = false;
		/*
		 * Past handlerTimeout the client gets a 504.  In autocommit mode the
		 * lease is left to run out (no more heartbeats), so a retry may take the
		 * key over; the fencing token tells the downstream which attempt is
		 * newer.  In transactional mode the transaction's connection is
		 * destroyed now: the server rolls back the handler's writes and the
		 * uncommitted claim, so the connection goes back to the pool and the
		 * key is free at once, as after a thrown error; the late handler's
		 * statements on it fail, and its answer is dropped.
		 */
		const timer = handlerTimeout > 0 ? setTimeout(() => {
			if (settled)
				return;
			timedOut = true;
			heartbeat?.stop();
			if (client) {
				client.release(new IdempotencyError(`the handler of key ${JSON.stringify(key)} ` +
					`ran past handlerTimeout (${handlerTimeout} s); its transaction is rolled back`));
				client = null;
			}
			controller.abort(new IdempotencyError(`the handler of key ${JSON.stringify(key)} ` +
				`ran past handlerTimeout (${handlerTimeout} s)`));
			log(`pg-idempotency: the handler of key ${JSON.stringify(key)} ran past ` +
				`handlerTimeout (${handlerTimeout} s); answered 504`);
			req.onTimeout(problem('idempotency-handler-timeout', 504,
				`The request handler did not answer within ${handlerTimeout} s. Its outcome is ` +
				'unknown: retry later with the same Idempotency-Key to get the stored result, ' +
				'or to run the request again once its lease has ended.'));
		}, handlerTimeout * 1000) : null;
		timer?.unref?.();

		async function complete(response) {
			if (settled)
				throw new IdempotencyError('the response of this attempt was already completed');
			settled = true;
			clearTimeout(timer);
			await heartbeat?.stop();
			if (timedOut && transactional) {
				/* the client was told 504 and the transaction is gone: nothing to store */
				log(`pg-idempotency: the late handler of key ${JSON.stringify(key)} finished; ` +
					'its transaction was rolled back at the timeout and its answer is dropped');
				return null;
			}
			const answer = await store(response);
			return timedOut ? null : answer;
		}

		async function store(response) {
			const status = response.status;
			const headers = normaliseHeaders(response.headers);
			headers['idempotency-key-retention'] = retentionHeader;
			/* 204 and 304 carry no body, whatever a framework put in its payload */
			const body = hasBody(status) ? response.body ?? Buffer.alloc(0) : Buffer.alloc(0);
			if (lost) {
				log(`pg-idempotency: key ${JSON.stringify(key)} was lost while its handler ran; ` +
					'the result was not stored');
				if (client) {
					await discard(client);
					client = null;
				}
				return lostKey();
			}
			let decision;
			try {
				/* a thrown error says nothing about the request: the key is released */
				decision = response.threw ? 'release' : storePolicy(status);
				if (decision !== 'succeeded' && decision !== 'failed' && decision !== 'release')
					throw new TypeError(`storePolicy(${status}) returned ${String(decision)}; ` +
						"expected 'succeeded', 'failed' or 'release'");
			} catch (err) {
				/* nothing is stored: give the key (and a transaction's client) back */
				if (client) {
					await discard(client);
					client = null;
				} else {
					await releaseOrLost(pool, key, token, scope).catch((e) =>
						log('pg-idempotency: release failed; the key frees itself when its lease ends', e));
				}
				throw err;
			}
			if (decision === 'release') {
				try {
					if (client) {
						await client.query('ROLLBACK');
						client.release();
						client = null;
					} else {
						await releaseOrLost(pool, key, token, scope);
					}
				} catch (err) {
					if (err instanceof KeyLostError) {
						log(`pg-idempotency: key ${JSON.stringify(key)} was lost before its release`, err);
						return lostKey();
					}
					log('pg-idempotency: release failed; the key frees itself when its lease ends', err);
					if (client) {
						await discard(client);
						client = null;
					}
				}
				return { status, headers, body };
			}

			const stored = {};
			for (const name of storeHeaders)
				if (headers[name] !== undefined)
					stored[name] = headerValue(headers[name]);
			let member = bodyMember(headers['content-type'], body);
			const envelopeOf = (m) => `{"v":1,"headers":${JSON.stringify(stored)}` +
				(m === null ? '' : m.json !== undefined
					? `,"json":${m.json}` : `,"base64":"${m.base64}"`) + '}';
			let full = envelopeOf(member);
			const withoutBody = () => {
				const kept = {};
				for (const name of omittedHeaders)
					if (stored[name] !== undefined)
						kept[name] = stored[name];
				return { envelope: JSON.stringify({ v: 1, headers: kept, omitted: 'too-large' }), kept };
			};
			const maxResponseSize = info.maxResponseSize;
			let omitted = Buffer.byteLength(full) > maxResponseSize ? withoutBody() : null;
			/*
			 * A refused finish is tried again in another form, never given up
			 * by releasing the key: the handler ran, and a release would let a
			 * retry run it again.  Over the size limit (54000): without the
			 * body.  A JSON body jsonb cannot hold (class 22, e.g. a number
			 * numeric cannot hold): the handler's bytes as base64.
			 */
			const retryForm = (err) => {
				if (omitted === null && err?.code === SQLSTATE.tooLarge) {
					omitted = withoutBody();
					return true;
				}
				if (omitted === null && member?.json !== undefined && /^22/.test(String(err?.code))) {
					member = { base64: body.toString('base64') };
					full = envelopeOf(member);
					if (Buffer.byteLength(full) > maxResponseSize)
						omitted = withoutBody();
					return true;
				}
				return false;
			};
			let row;
			try {
				if (client) {
					let backToHandler = failedWrites === 'rollback' && decision === 'failed';
					if (backToHandler)
						await client.query('ROLLBACK TO SAVEPOINT idem_handler');
					for (;;) {
						/* a savepoint per try, so that a refused finish leaves the transaction usable */
						try {
							await client.query('SAVEPOINT idem_finish');
						} catch (err) {
							/* a failed statement of the handler aborted it: a failed outcome is still stored */
							if (err?.code !== SQLSTATE.aborted || decision !== 'failed' || backToHandler)
								throw err;
							backToHandler = true;
							await client.query('ROLLBACK TO SAVEPOINT idem_handler');
							continue;
						}
						try {
							row = (await client.query(HTTP_FINISH_SQL, finishParams(omitted, full, member, decision, status))).rows[0];
							break;
						} catch (err) {
							if (!retryForm(err))
								throw err;
							await client.query('ROLLBACK TO SAVEPOINT idem_finish');
						}
					}
					await client.query('COMMIT');
					client.release();
					client = null;
				} else {
					for (;;) {
						try {
							row = await finishOrLost(pool, finishParams(omitted, full, member, decision, status), undefined, HTTP_FINISH_SQL);
							break;
						} catch (err) {
							if (!retryForm(err))
								throw err;
						}
					}
				}
			} catch (err) {
				if (client) {
					await discard(client);
					client = null;
				}
				if (err instanceof KeyLostError || isLostKey(err)) {
					log(`pg-idempotency: key ${JSON.stringify(key)} was lost before its finish; ` +
						'the result was not stored', err);
					return lostKey();
				}
				/*
				 * Not released: the handler ran.  In autocommit mode the claim
				 * stays with this attempt until its lease ends (the heartbeat is
				 * stopped), then a retry takes the key over; in transactional
				 * mode the rollback took the handler's writes with the claim.
				 */
				if (isUnavailable(err) || (transactional && err?.code === SQLSTATE.aborted)) {
					log(`pg-idempotency: the result of key ${JSON.stringify(key)} could not be stored; ` +
						(transactional ? 'the transaction was rolled back'
							: 'the key is not released: a retry takes it over when its lease ends'), err);
					return unavailable();
				}
				const code = err?.code;
				return misconfigured(code === '42501' || code === '42883' || code === '3F000'
					? misconfigurationDetail(err, info.database)
					: `Storing the result failed with ${code ?? 'an error'} (${String(err?.message ?? err)}); ` +
						'retrying does not help: check the database and the idempotency extension.', err);
			}
			if (omitted !== null) {
				/* this client gets the whole response; retries get its status and headers */
				if (cache)
					cache.set(cacheId, requestText, replayResponse({
						headers: JSON.stringify(omitted.kept), json: null, base64: null,
						omitted: 'too-large', response_code: status,
					}), row.expires_ms);
				return { status, headers, body };
			}
			/* what this client sees is what every retry will see, byte for byte */
			const sent = member?.json !== undefined ? Buffer.from(row.json) : body;
			if (!sent.equals(body)) {
				/* an ETag named the bytes the handler wrote, which nobody gets */
				delete headers.etag;
				delete stored.etag;
			}
			if (cache)
				cache.set(cacheId, requestText, replayResponse({
					headers: JSON.stringify(stored), json: member?.json !== undefined ? row.json : null,
					base64: member?.base64 ?? null, response_code: status,
				}), row.expires_ms);
			return { status, headers, body: sent };
		}

		function finishParams(omitted, full, member, decision, status) {
			return [key, token, status, omitted === null ? full : omitted.envelope, scope, decision,
				retention, omitted === null && member?.json !== undefined ? member.json : null];
		}

		/* the request died without a response: give the key back */
		async function abandon(err) {
			if (settled)
				return;
			settled = true;
			clearTimeout(timer);
			await heartbeat?.stop();
			if (client) {
				await discard(client);
				client = null;
			} else if (!transactional) {
				await releaseOrLost(pool, key, token, scope).catch(() => {});
			}
			log('pg-idempotency: the request ended without a response; key released', err);
		}

		return { action: 'run', context, complete, abandon, get timedOut() { return timedOut; } };
	}

	/*
	 * The key may have been swept, or swept and settled anew, between the claim
	 * and this lookup: only the expiry of the replayed result itself may keep
	 * it in the cache.
	 */
	async function fillCache(cacheId, requestText, response, claim, key, scope) {
		try {
			const { rows } = await pool.query(LOOKUP_SQL, [key, scope]);
			const found = rows[0];
			if (found && found.status === claim.status && found.response_code === claim.response_code &&
				found.headers === claim.headers && found.json === claim.json &&
				found.base64 === claim.base64 && found.omitted === claim.omitted)
				cache.set(cacheId, requestText, response, found.expires_ms);
		} catch (err) {
			log('pg-idempotency: lookup for the cache failed', err);
		}
	}

	return { begin, cache, retentionHeader, problem, misconfigured };
}

/* roll back and return the client; a client that cannot roll back is destroyed */
async function discard(client) {
	try {
		await client.query('ROLLBACK');
		client.release();
	} catch (err) {
		client.release(err);
	}
}

/* ------------------------------------------------------------------ Express */

const RAW_BODY = Symbol.for('pg-idempotency.rawBody');
const THREW = Symbol('pg-idempotency.threw');
/* the engine's attempt of a covered request (Express and Fastify) */
const ATTEMPT = Symbol('pg-idempotency.attempt');

/*
 * A body parser's verify hook that keeps the raw bytes for the fingerprint:
 * express.json({ verify: rawBody }), express.raw({ type: '*\/*', verify: rawBody }).
 */
function rawBody(req, _res, buf) {
	req.rawBody = Buffer.from(buf);
}

function readStream(stream) {
	return new Promise((resolve, reject) => {
		const chunks = [];
		stream.on('data', (c) => chunks.push(Buffer.isBuffer(c) ? c : Buffer.from(c)));
		stream.on('end', () => resolve(Buffer.concat(chunks)));
		stream.on('error', reject);
	});
}

/*
 * Read a request body that no parser has read yet (at most limit + 1 bytes)
 * and put it back: the bytes are unshifted into the stream before it emits
 * 'end', so a body parser mounted after the middleware (express.json(),
 * express.text(), ...) reads the whole body as if nobody had.
 */
function peekBody(req, limit) {
	return new Promise((resolve, reject) => {
		/*
		 * An empty body that ended before anyone listened (an await came
		 * first: a key(req) option, an async middleware) emits no 'readable'
		 * any more: it is empty, and nothing needs to be put back.
		 */
		if (req.complete && req.readableLength === 0) {
			resolve(Buffer.alloc(0));
			return;
		}
		const chunks = [];
		let size = 0;
		const finish = (value, err) => {
			req.off('readable', onReadable);
			req.off('end', onEnd);
			req.off('error', onError);
			req.off('close', onClose);
			if (err)
				reject(err);
			else
				resolve(value);
		};
		function onReadable() {
			while (req.readableLength > 0) {
				/* an exact length: reading the last byte with read() would schedule 'end' */
				const chunk = req.read(req.readableLength);
				if (chunk === null)
					break;
				const buf = Buffer.isBuffer(chunk) ? chunk : Buffer.from(chunk);
				chunks.push(buf);
				size += buf.length;
				if (size > limit)
					return finish(TOO_LARGE);
			}
			if (req.complete && req.readableLength === 0) {
				const body = Buffer.concat(chunks);
				if (body.length > 0)
					req.unshift(body);
				finish(body);
			}
		}
		/* the stream ended under us: what was read is the body, nothing is left to put back */
		function onEnd() {
			finish(Buffer.concat(chunks));
		}
		function onError(err) {
			finish(undefined, err);
		}
		function onClose() {
			if (!req.complete)
				finish(undefined, new IdempotencyError('the request was aborted while its body was read'));
		}
		req.on('readable', onReadable);
		req.on('end', onEnd);
		req.on('error', onError);
		req.on('close', onClose);
	});
}

/* the raw request body of a Node request, wherever a parser left it */
async function expressRawBody(req, limit) {
	let body = null;
	if (Buffer.isBuffer(req.rawBody))
		body = req.rawBody;
	else if (typeof req.rawBody === 'string')
		body = Buffer.from(req.rawBody);
	else if (Buffer.isBuffer(req.body))
		body = req.body;
	if (body !== null)
		return body.length > limit ? TOO_LARGE : body;
	if (req.complete && !req.readable)
		throw new MisconfiguredError('A body parser read the request body before the idempotency ' +
			'middleware without keeping its bytes, which the fingerprint needs: pass ' +
			'{ verify: rawBody } to the body parser (express.json({ verify: rawBody })), or mount ' +
			'the middleware before the parser.');
	body = await peekBody(req, limit);
	if (body !== TOO_LARGE)
		req.rawBody = body;
	return body;
}

function keyLinesOf(headers, headersDistinct) {
	if (headersDistinct)
		return headersDistinct['idempotency-key'];
	const v = headers['idempotency-key'];
	return v === undefined ? undefined : [v];
}

function toBuffer(chunk, encoding) {
	if (chunk === undefined || chunk === null)
		return null;
	if (Buffer.isBuffer(chunk))
		return chunk;
	if (chunk instanceof Uint8Array)
		return Buffer.from(chunk.buffer, chunk.byteOffset, chunk.byteLength);
	return Buffer.from(String(chunk), typeof encoding === 'string' ? encoding : 'utf8');
}

/* write a whole response on a Node ServerResponse, with its own framing */
function sendNode(res, response, original = res) {
	res.statusCode = response.status;
	for (const [name, value] of Object.entries(response.headers))
		if (!FRAMING_HEADERS.has(name.toLowerCase()))
			res.setHeader(name, value);
	for (const name of FRAMING_HEADERS)
		res.removeHeader(name);
	if (hasBody(response.status)) {
		res.setHeader('content-length', String(response.body.length));
		original.end.call(res, response.body);
	} else {
		original.end.call(res);
	}
}

/* 204 and 304 carry no body, and so no content-length */
function hasBody(status) {
	return status !== 204 && status !== 304;
}

/*
 * After a 504 went out, the late handler still writes its response: into
 * these headers of its own, which complete() stores, instead of the
 * response already sent.
 */
function detachHeaders(res, initial) {
	const headers = new Map(Object.entries(initial).map(([n, v]) => [n.toLowerCase(), v]));
	res.setHeader = (name, value) => {
		headers.set(String(name).toLowerCase(), value);
		return res;
	};
	res.appendHeader = (name, value) => {
		const n = String(name).toLowerCase();
		const old = headers.get(n);
		headers.set(n, old === undefined ? value : [].concat(old, value));
		return res;
	};
	res.getHeader = (name) => headers.get(String(name).toLowerCase());
	res.getHeaders = () => Object.fromEntries(headers);
	res.getHeaderNames = () => [...headers.keys()];
	res.hasHeader = (name) => headers.has(String(name).toLowerCase());
	res.removeHeader = (name) => { headers.delete(String(name).toLowerCase()); };
}

/*
 * expressIdempotency(options): middleware for Express 4 and 5 (and plain
 * connect/http style servers).  The route's handler answers as usual
 * (res.status().json(), res.send(buffer), a stream...); the middleware holds
 * the response back until it is stored, then sends what retries will get.
 * The handler finds the key, token, attempt, and in transactional mode the pg
 * client, on req.idempotency.
 */
function expressIdempotency(options) {
	const engine = createEngine(options);

	function make(transactional) {
		return async function pgIdempotency(req, res, next) {
			try {
				await handle(req, res, next, transactional);
			} catch (err) {
				next(err);
			}
		};
	}

	async function handle(req, res, next, transactional) {
		let onTimeout = null;
		const started = await engine.begin({
			method: req.method,
			path: req.originalUrl ?? req.url,
			keyLines: keyLinesOf(req.headers, req.headersDistinct),
			contentLength: req.headers['content-length'],
			contentType: req.headers['content-type'],
			rawBody: (limit) => expressRawBody(req, limit),
			onTimeout: (response) => onTimeout?.(response),
			original: req,
		}, { transactional });
		if (started.action === 'pass')
			return next();
		if (started.action === 'respond')
			return sendNode(res, started.response);

		const { context, complete } = started;
		req.idempotency = context;
		req[ATTEMPT] = started;
		const original = { writeHead: res.writeHead, write: res.write, end: res.end };
		const chunks = [];
		let ended = false;
		res.setHeader('idempotency-key-retention', engine.retentionHeader);
		const restore = () => {
			res.writeHead = original.writeHead;
			res.write = original.write;
			res.end = original.end;
		};

		onTimeout = (response) => {
			if (res.headersSent)
				return;
			const handlerStatus = res.statusCode;
			const handlerHeaders = res.getHeaders();
			const held = { writeHead: res.writeHead, write: res.write, end: res.end };
			for (const name of res.getHeaderNames())
				res.removeHeader(name);
			restore();
			sendNode(res, response, original);
			Object.assign(res, held);
			detachHeaders(res, handlerHeaders);
			res.statusCode = handlerStatus;
		};

		/* the handler's writes are held until the result is stored */
		res.writeHead = function writeHead(statusCode, reason, headers) {
			if (typeof reason !== 'string') {
				headers = reason;
				reason = undefined;
			}
			res.statusCode = statusCode;
			if (reason)
				res.statusMessage = reason;
			if (Array.isArray(headers)) {
				for (let i = 0; i + 1 < headers.length; i += 2)
					res.setHeader(headers[i], headers[i + 1]);
			} else if (headers) {
				for (const [name, value] of Object.entries(headers))
					res.setHeader(name, value);
			}
			return res;
		};
		res.write = function write(chunk, encoding, callback) {
			if (typeof encoding === 'function')
				[callback, encoding] = [encoding, undefined];
			const buf = toBuffer(chunk, encoding);
			if (buf)
				chunks.push(buf);
			if (callback)
				process.nextTick(callback);
			return true;
		};
		res.end = function end(chunk, encoding, callback) {
			if (typeof chunk === 'function')
				[callback, chunk] = [chunk, undefined];
			else if (typeof encoding === 'function')
				[callback, encoding] = [encoding, undefined];
			if (ended)
				return res;
			ended = true;
			const buf = toBuffer(chunk, encoding);
			if (buf)
				chunks.push(buf);
			if (callback)
				res.once('finish', callback);
			complete({
				status: res.statusCode, headers: res.getHeaders(), body: Buffer.concat(chunks),
				threw: req[THREW] !== undefined,
			})
				.then((answer) => {
					if (answer === null || res.headersSent)
						return;            /* the 504 was the answer */
					restore();
					for (const name of res.getHeaderNames())
						if (!(name in answer.headers))
							res.removeHeader(name);
					sendNode(res, answer, original);
				}, (err) => {
					restore();
					next(err);
				});
			return res;
		};
		return next();
	}

	const middleware = make(false);
	middleware.transactional = make(true);
	middleware.cache = engine.cache;
	/*
	 * Error middleware to mount after the routes: Express gives a
	 * middleware no other way to tell a thrown error from a 5xx the handler
	 * sends, and a thrown error releases the key even with storeServerErrors.
	 */
	middleware.errors = function pgIdempotencyErrors(err, req, res, next) {
		const started = req[ATTEMPT];
		if (started && !res.headersSent) {
			req[THREW] = err ?? new Error('the handler failed');
		} else if (started?.timedOut) {
			/* the 504 went out and the handler threw later: its attempt ends here, key released */
			started.abandon(err ?? new Error('the handler failed after its timeout')).catch(() => {});
		}
		next(err);
	};
	return middleware;
}

/* ------------------------------------------------------------------ Fastify */

const BODY_TOO_LARGE = Symbol('pg-idempotency.bodyTooLarge');

/*
 * fastifyIdempotency: a Fastify 5 plugin.  It covers every route of the
 * methods option in the context it is registered in (and, with skip-override,
 * that context is the parent's).  Per route: config: { idempotency: false }
 * turns it off, config: { idempotency: { transactional: true } } runs the
 * route in one transaction on request.idempotency.client.
 */
async function fastifyIdempotency(fastify, options) {
	const engine = createEngine(options);
	const methods = new Set((options.methods ?? ['POST', 'PATCH']).map((m) => m.toUpperCase()));
	const maxBodySize = bodyLimit(options.maxBodySize);

	if (!fastify.hasRequestDecorator('idempotency'))
		fastify.decorateRequest('idempotency', null);

	const routeSetting = (request) => request.routeOptions?.config?.idempotency;

	/* keep the raw bytes for the fingerprint (at most maxBodySize + 1), whatever the content type parser does */
	fastify.addHook('preParsing', async (request, reply, payload) => {
		if (!methods.has(request.method) || routeSetting(request) === false)
			return payload;
		const chunks = [];
		let size = 0;
		const tee = new Transform({
			transform(chunk, encoding, callback) {
				const buf = Buffer.isBuffer(chunk) ? chunk : Buffer.from(chunk, encoding);
				size += buf.length;
				if (size > maxBodySize)
					request[BODY_TOO_LARGE] = true;
				else
					chunks.push(buf);
				tee.receivedEncodedLength = payload.receivedEncodedLength;
				callback(null, chunk);
			},
			flush(callback) {
				request[RAW_BODY] = request[BODY_TOO_LARGE] ? TOO_LARGE : Buffer.concat(chunks);
				callback();
			},
		});
		payload.on('error', (err) => tee.destroy(err));
		return payload.pipe(tee);
	});

	/* a thrown error releases the key, whatever status the error handler answers */
	fastify.addHook('onError', async (request, reply, error) => {
		if (request[ATTEMPT])
			request[THREW] = error;
	});

	/* after validation, so that a request refused by its schema does not use up its key */
	fastify.addHook('preHandler', async (request, reply) => {
		const setting = routeSetting(request);
		if (setting === false)
			return;
		let onTimeout = null;
		const started = await engine.begin({
			method: request.method,
			path: request.raw.url,
			keyLines: keyLinesOf(request.headers, request.raw.headersDistinct),
			contentLength: request.headers['content-length'],
			contentType: request.headers['content-type'],
			rawBody: async () => (request[BODY_TOO_LARGE] ? TOO_LARGE : request[RAW_BODY] ?? Buffer.alloc(0)),
			onTimeout: (response) => onTimeout?.(response),
			original: request,
		}, { transactional: setting?.transactional === true });
		if (started.action === 'pass')
			return;
		if (started.action === 'respond') {
			const { status, headers, body } = started.response;
			reply.code(status).headers(headers);
			/* an empty body goes as no payload, which Fastify gives no content type of its own */
			return reply.send(hasBody(status) && body.length > 0 ? body : undefined);
		}
		request.idempotency = started.context;
		request[ATTEMPT] = started;
		reply.header('idempotency-key-retention', engine.retentionHeader);
		/*
		 * Past handlerTimeout the 504 goes out now; the late handler's answer
		 * (returned or sent) reaches the replaced send() and is completed, not sent.
		 */
		onTimeout = (response) => {
			if (reply.sent || request[ATTEMPT] !== started)
				return;
			request[ATTEMPT] = null;
			const send = reply.send;
			const handlerHeaders = reply.getHeaders();
			const handlerStatus = reply.statusCode;
			for (const name of Object.keys(handlerHeaders))
				reply.removeHeader(name);
			reply.code(response.status).headers(response.headers);
			reply.header('content-length', String(response.body.length));
			send.call(reply, response.body);
			let late = false;
			reply.send = function lateSend(payload) {
				/* `return reply.send(x)` hands the reply itself back: x was taken already */
				if (late || payload === reply)
					return reply;
				late = true;
				let body;
				let headers = { ...handlerHeaders };
				if (payload === null || payload === undefined)
					body = Buffer.alloc(0);
				else if (Buffer.isBuffer(payload) || typeof payload === 'string')
					body = toBuffer(payload);
				else {
					body = Buffer.from(JSON.stringify(payload));
					headers = { 'content-type': 'application/json; charset=utf-8', ...headers };
				}
				const status = reply.statusCode === response.status ? handlerStatus : reply.statusCode;
				started.complete({ status, headers, body, threw: payload instanceof Error })
					.catch((err) => request.log.error(err));
				return reply;
			};
		};
	});

	fastify.addHook('onSend', async (request, reply, payload) => {
		const started = request[ATTEMPT];
		if (!started)
			return payload;
		request[ATTEMPT] = null;
		let body;
		if (payload === null || payload === undefined)
			body = Buffer.alloc(0);
		else if (typeof payload.pipe === 'function')
			body = await readStream(payload);
		else
			body = toBuffer(payload);
		const response = await started.complete({
			status: reply.statusCode, headers: reply.getHeaders(), body,
			threw: request[THREW] !== undefined,
		});
		reply.code(response.status);
		for (const name of Object.keys(reply.getHeaders()))
			if (!(name in response.headers))
				reply.removeHeader(name);
		reply.headers(response.headers);
		for (const name of FRAMING_HEADERS)
			reply.removeHeader(name);
		if (!hasBody(response.status)) {
			reply.removeHeader('content-length');
			return null;
		}
		reply.header('content-length', String(response.body.length));
		return response.body;
	});

	/* a request that ends without a reply (e.g. hijacked) gives its key back */
	fastify.addHook('onResponse', async (request) => {
		const started = request[ATTEMPT];
		if (started) {
			request[ATTEMPT] = null;
			await started.abandon(new Error('the request ended without a reply'));
		}
	});
}
/* the plugin applies to the context it is registered in, with no fastify-plugin */
fastifyIdempotency[Symbol.for('skip-override')] = true;
fastifyIdempotency[Symbol.for('fastify.display-name')] = 'pg-idempotency';
fastifyIdempotency[Symbol.for('plugin-meta')] = { name: 'pg-idempotency', fastify: '>=5' };

/* the attempt of an Express or Fastify request, if the request is covered and claimed */
function idempotencyContext(req) {
	return req?.idempotency ?? undefined;
}

module.exports = {
	idempotent,
	idempotentJob,
	currentJob,
	expressIdempotency,
	fastifyIdempotency,
	rawBody,
	idempotencyContext,
	parseIdempotencyKey,
	defaultStorePolicy,
	IdempotencyError,
	InProgressError,
	MismatchError,
	StoredFailureError,
	KeyLostError,
	MisconfiguredError,
	MAX_KEY_LENGTH,
	PROBLEMS,
};
