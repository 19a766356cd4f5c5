'use strict';
/*
 * What the job API and the HTTP engine share: the statements both send to the
 * extension, the SQLSTATEs they react to and what an error means (a lost key,
 * a transient failure, an unavailable store, a misconfiguration), the
 * extension's version and settings read once per pool, the checks of
 * duration options, and the parts of a claimed attempt: its lease
 * (the heartbeat), its checkpoints, its finish and its release.
 */

const { MisconfiguredError, KeyLostError } = require('./errors.cjs');

const DEFAULT_LEASE = 30;            /* seconds */
const DEFAULT_RETENTION = 86400;     /* seconds: 24 h */
/* the server's default idempotency.max_response_size, when the setting cannot be read */
const DEFAULT_MAX_RESPONSE_SIZE = 1024 * 1024;
/* named in the errors that ask for a newer extension */
const CLIENT_VERSION = require('../package.json').version;
/*
 * Every statement this client always sends (idem_claim, idem_finish,
 * idem_extend, idem_release, idem_lookup with the named arguments used
 * here) exists since extension 1.0; checkpoint() and sessionBound need 1.4
 * and say so through PostgreSQL's 42883 when they are used on an older one.
 */
const MIN_EXTENSION_VERSION = '1.0';
/* recovery points and session-bound claims came with 1.4 */
const RECOVERY_EXTENSION_VERSION = '1.4';
/* remembered keys (idem_claim's and idem_finish's remember argument) came with 1.7 */
const REMEMBER_EXTENSION_VERSION = '1.7';
/* completers (idem_claim_abandoned, idem_claim's keep_request) came with 1.8 */
const COMPLETER_EXTENSION_VERSION = '1.8';

/* SQLSTATEs of the extension this client reacts to */
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
 * session_bound and keep_request are named only when they are true, for the
 * same reason, and remember only when the caller set it (rememberArg).
 */
const claimSql = (sessionBound, remember, keepRequest) => `
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
	sessionBound ? ',\n                              session_bound => true' : ''}${
	remember ? rememberArg(7) : ''}${
	keepRequest ? ',\n                              keep_request => true' : ''}) AS c`;

/*
 * The remember argument of idem_claim and idem_finish, as parameter $n: named
 * only when the caller set the option, so that a client without it keeps
 * working on extension versions before 1.7, which lack the argument.
 */
function rememberArg(n) {
	return `,\n                              remember => pg_catalog.make_interval(secs => $${n}::float8)`;
}

/* each statement's text, by which of session_bound, remember and keep_request it names */
const CLAIM_SQL = new Map();
for (const sessionBound of [false, true])
	for (const remember of [false, true])
		for (const keepRequest of [false, true])
			CLAIM_SQL.set(`${sessionBound}/${remember}/${keepRequest}`, claimSql(sessionBound, remember, keepRequest));

/* the claim's statement and parameters; remember is null when not set */
function claimStatement({
	key, request, scope, lease, retention, wait, sessionBound = false, remember = null, keepRequest = false,
}) {
	const params = [key, request, scope, lease, retention, wait];
	if (remember !== null)
		params.push(remember);
	return { sql: CLAIM_SQL.get(`${sessionBound}/${remember !== null}/${keepRequest}`), params };
}

const CHECKPOINT_SQL = `
SELECT idempotency.idem_checkpoint(key => $1, token => $2::bigint, phase => $3,
                                   data => $4::jsonb, scope => $5)`;

const finishSql = (remember) => `
SELECT (pg_catalog.date_part('epoch', f.expires_at) * 1000)::float8 AS expires_ms,
       ($4::jsonb -> 'json')::text AS json
  FROM idempotency.idem_finish(key => $1, token => $2::bigint, response_code => $3::int,
                               response_body => $4::jsonb, scope => $5, status => $6,
                               retention => pg_catalog.make_interval(secs => $7::float8)${
	remember ? rememberArg(8) : ''})
       AS f(expires_at)`;
const FINISH_SQL = [finishSql(false), finishSql(true)];

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

/* the remember option: null when not set (the server's idempotency.remember applies) */
function rememberSeconds(value) {
	return seconds(value, 'remember', null);
}

/* remember needs 1.7; without it nothing does */
function requireRemember(info, remember) {
	if (remember !== null)
		requireVersion(info, REMEMBER_EXTENSION_VERSION, ' (remember)');
}

/* the keepRequest option: a boolean, false when not set */
function keepRequestOption(value) {
	if (value === undefined || value === null)
		return false;
	if (typeof value !== 'boolean')
		throw new TypeError(`keepRequest must be a boolean, got ${String(value)}`);
	return value;
}

/* keepRequest needs 1.8; without it nothing does */
function requireKeepRequest(info, keepRequest) {
	if (keepRequest)
		requireVersion(info, COMPLETER_EXTENSION_VERSION, ' (keepRequest)');
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

/*
 * params are the finish's first seven (key, token, code, body, scope, status,
 * retention), then remember when set; sql is FINISH_SQL's text for them.
 */
async function finishOrLost(db, params, cause, sql = FINISH_SQL[params.length > 7 ? 1 : 0]) {
	try {
		return (await queryWithRetry(db, sql, params)).rows[0];
	} catch (err) {
		if (isLostKey(err))
			throw new KeyLostError(params[0], { cause: cause ?? err });
		throw err;
	}
}

/*
 * The application's hooks: onClaim, onReplay, onConflict, onMismatch,
 * onExpired and onError, each called with an event (key, scope, request, and
 * the token and attempt where there is one).  A hook observes: one that throws, or whose
 * promise rejects, is logged and changes no answer, and a promise is not
 * waited for.
 */
const HOOKS = {
	onClaim: 'claim', onReplay: 'replay', onConflict: 'conflict', onMismatch: 'mismatch',
	onExpired: 'expired', onError: 'error',
};

function makeHooks(options, log, names = HOOKS) {
	const hooks = {};
	for (const [option, name] of Object.entries(names)) {
		const fn = options?.[option] ?? null;
		if (fn !== null && typeof fn !== 'function')
			throw new TypeError(`${option} must be a function, got ${typeof fn}`);
		const failed = (err) => log(`pg-idempotency: the ${option} hook failed; the answer is unchanged`, err);
		hooks[name] = fn === null ? () => {} : (event) => {
			try {
				const result = fn(event);
				if (result && typeof result.then === 'function')
					result.then(undefined, failed);
			} catch (err) {
				failed(err);
			}
		};
	}
	return hooks;
}

module.exports = {
	DEFAULT_LEASE,
	DEFAULT_RETENTION,
	RECOVERY_EXTENSION_VERSION,
	COMPLETER_EXTENSION_VERSION,
	SQLSTATE,
	FINISH_SQL,
	rememberArg,
	claimStatement,
	isUnavailable,
	knownDatabase,
	misconfigurationDetail,
	requireVersion,
	poolInfo,
	isLostKey,
	seconds,
	positiveSeconds,
	rememberSeconds,
	requireRemember,
	keepRequestOption,
	requireKeepRequest,
	toJsonText,
	queryWithRetry,
	startHeartbeat,
	defaultLog,
	makeHooks,
	phaseDataOf,
	makeCheckpoint,
	releaseOrLost,
	finishOrLost,
};
