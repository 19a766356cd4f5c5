'use strict';
/*
 * pg-idempotency: idempotency keys for node-postgres on top of the idempotency
 * PostgreSQL extension.  The database holds every key's state; this module maps
 * the extension's four claim outcomes onto jobs (idempotent()) and onto HTTP
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

const MAX_KEY_LENGTH = 255;
const DEFAULT_LEASE = 30;            /* seconds */
const DEFAULT_RETENTION = 86400;     /* seconds: 24 h */
const DEFAULT_PROBLEM_BASE = 'urn:idempotency:problem:';
const DEFAULT_STORE_HEADERS = ['content-type', 'content-encoding', 'location'];

/* SQLSTATEs of the extension this module reacts to */
const SQLSTATE = {
	noSuchKey: 'P0002',
	finishedByOther: '55000',
	deadToken: '55006',
	keyBusy: '55P03',
	deadlock: '40P01',
	serialization: '40001',
	readOnly: '25006',
};

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
       l.response_body ->> 'base64' AS base64
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

/* ----------------------------------------------------------------- helpers */

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
function makeCheckpoint(db, { key, token, scope, defaultClient, onLost }) {
	return async function checkpoint(phase, data, options) {
		if (typeof phase !== 'string')
			throw new TypeError('checkpoint(phase, data) needs the name of the completed step (a string)');
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
				return await runClaimed(pool, claim, { key, scope, lease, retention, retryable, log }, fn);
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
			return runClaimed(pool, claim, { key, scope, lease, retention, retryable, log }, fn);
		default:
			throw new IdempotencyError(`unexpected claim outcome ${claim.outcome}`);
	}
}

/* run fn for a claimed key, keep its lease alive, then store its result or give the key back */
async function runClaimed(pool, claim, { key, scope, lease, retention, retryable, log }, fn) {
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
	const checkpoint = makeCheckpoint(pool, { key, token, scope, onLost });

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

async function finishOrLost(db, params, cause) {
	try {
		return (await queryWithRetry(db, FINISH_SQL, params)).rows[0];
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

const PROBLEM_TITLES = {
	'idempotency-key-missing': 'Idempotency-Key header missing',
	'idempotency-key-repeated': 'Idempotency-Key header repeated',
	'idempotency-key-malformed': 'Malformed Idempotency-Key',
	'idempotency-key-too-long': 'Idempotency-Key too long',
	'idempotency-key-in-use': 'A request with this Idempotency-Key is in progress',
	'idempotency-key-reused': 'Idempotency-Key reused with a different request',
	'idempotency-key-lost': 'Request attempt superseded',
	'idempotency-unavailable': 'Idempotency store briefly unavailable',
};

/* -------------------------------------------------------------- HTTP engine */

/* Stripe's documented behaviour: what a status means for the key */
function defaultStorePolicy(status) {
	if (status >= 500)
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

/*
 * The envelope's body member: "json" when the body is JSON that jsonb keeps
 * as it is, "base64" otherwise.  jsonb refuses \u0000 and unpaired surrogate
 * escapes, so a body that holds such escapes is kept as bytes instead.
 */
function bodyMember(contentType, body) {
	if (body.length === 0)
		return null;
	if (isJsonType(contentType)) {
		let text = null;
		try {
			text = utf8.decode(body);
			JSON.parse(text);
		} catch {
			text = null;
		}
		if (text !== null && !/\\u(0000|d[89a-f][0-9a-f]{2})/i.test(text))
			return { json: text };
	}
	return { base64: body.toString('base64') };
}

function headerValue(value) {
	if (Array.isArray(value))
		return value.map(String).join(', ');
	return String(value);
}

function normaliseHeaders(headers) {
	const out = {};
	for (const [name, value] of Object.entries(headers ?? {}))
		if (value !== undefined && value !== null)
			out[name.toLowerCase()] = value;
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
 * The framework-free part of the HTTP behaviour.  A framework adapter calls
 * begin() with the request's method, path, header lines and raw body; the
 * answer is one of:
 *   { action: 'pass' }                       not covered: run the route as usual
 *   { action: 'respond', response }          answer now (4xx, 409, 422, a replay)
 *   { action: 'run', context, complete, abandon }
 *       run the handler; hand its response to complete(), which stores it per
 *       the status policy and resolves to the response to send.
 */
function createEngine(options) {
	const pool = options?.pool;
	if (!pool || typeof pool.query !== 'function')
		throw new TypeError('pg-idempotency needs options.pool: a pg Pool');
	const methods = new Set((options.methods ?? ['POST', 'PATCH']).map((m) => m.toUpperCase()));
	const required = options.required ?? true;
	const scopeOf = options.scope ?? (() => '');
	const fingerprintOf = options.fingerprint ?? null;
	const lease = positiveSeconds(options.lease, 'lease', DEFAULT_LEASE);
	const retention = positiveSeconds(options.retention, 'retention', DEFAULT_RETENTION);
	const problemBase = options.problemTypeBase ?? DEFAULT_PROBLEM_BASE;
	const storePolicy = options.storePolicy ?? defaultStorePolicy;
	const storeHeaders = (options.storeHeaders ?? DEFAULT_STORE_HEADERS).map((h) => h.toLowerCase());
	const log = options.log ?? defaultLog;
	const cache = options.cache ? createCache(Math.max(1, options.cache.max ?? 1000)) : null;
	const retentionHeader = String(Math.round(retention));

	function problem(slug, status, detail, extraHeaders = {}) {
		const body = Buffer.from(JSON.stringify({
			type: problemBase + slug, title: PROBLEM_TITLES[slug], status, detail,
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

	const unavailable = () => problem('idempotency-unavailable', 503,
		'The result could not be recorded. Retry this request with the same Idempotency-Key.',
		{ 'retry-after': '1' });

	/* a stored envelope as an HTTP response */
	function replayResponse(row) {
		const headers = row.headers === null ? {} : JSON.parse(row.headers);
		let body = Buffer.alloc(0);
		if (row.json !== null)
			body = Buffer.from(row.json);
		else if (row.base64 !== null)
			body = Buffer.from(row.base64, 'base64');
		return {
			status: row.response_code ?? 200,
			headers: {
				...headers,
				'idempotent-replayed': 'true',
				'idempotency-key-retention': retentionHeader,
			},
			body,
		};
	}

	function releaseStatus(err) {
		return isTransient(err) || err?.code === SQLSTATE.readOnly ? unavailable() : null;
	}

	async function begin(req, { transactional = false } = {}) {
		if (!methods.has(String(req.method).toUpperCase()))
			return { action: 'pass' };
		const parsed = parseIdempotencyKey(req.keyLines);
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

		const key = parsed.key;
		const scope = String((await scopeOf(req.original)) ?? '');
		const fingerprint = fingerprintOf
			? await fingerprintOf(req.original)
			: {
				method: String(req.method).toUpperCase(),
				path: req.path,
				body_sha256: createHash('sha256').update(await req.rawBody()).digest('hex'),
			};
		const requestText = toJsonText(fingerprint, 'the request fingerprint');
		const cacheId = `${scope}\u0000${key}`;

		if (cache) {
			const hit = cache.get(cacheId, requestText);
			if (hit)
				return { action: 'respond', response: hit, cached: true };
		}

		let client = null;
		let claim;
		try {
			if (transactional) {
				client = await pool.connect();
				await client.query('BEGIN');
				claim = (await client.query(CLAIM_SQL,
					[key, requestText, scope, lease, retention, 0])).rows[0];
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
			const answer = releaseStatus(err);
			if (answer) {
				log('pg-idempotency: claim failed', err);
				return { action: 'respond', response: answer };
			}
			throw err;
		}

		switch (claim.outcome) {
			case 'replay': {
				const response = replayResponse(claim);
				if (cache)
					await fillCache(cacheId, requestText, response, claim, key, scope);
				return { action: 'respond', response };
			}
			case 'in_progress': {
				const retryAfter = String(claim.retry_after ?? 1);
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
			checkpoint: makeCheckpoint(pool, { key, token, scope, defaultClient: client, onLost }),
		};
		/* a transaction's claim is invisible to others until COMMIT: no lease to keep */
		const heartbeat = transactional ? null : startHeartbeat(pool, {
			key, token, scope, lease, log,
			onLost: (err) => onLost(new KeyLostError(key, { cause: err })),
			onBeat: options.onHeartbeat,
		});
		let settled = false;

		async function complete(response) {
			if (settled)
				throw new IdempotencyError('the response of this attempt was already completed');
			settled = true;
			await heartbeat?.stop();
			const status = response.status;
			const headers = normaliseHeaders(response.headers);
			headers['idempotency-key-retention'] = retentionHeader;
			/* 204 and 304 carry no body, whatever a framework put in its payload */
			const body = status === 204 || status === 304 ? Buffer.alloc(0) : response.body ?? Buffer.alloc(0);
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
				decision = storePolicy(status);
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
			const member = bodyMember(headers['content-type'], body);
			const envelope = `{"v":1,"headers":${JSON.stringify(stored)}` +
				(member === null ? '' : member.json !== undefined
					? `,"json":${member.json}` : `,"base64":"${member.base64}"`) + '}';
			const params = [key, token, status, envelope, scope, decision, retention];
			let row;
			try {
				if (client) {
					row = (await client.query(FINISH_SQL, params)).rows[0];
					await client.query('COMMIT');
					client.release();
					client = null;
				} else {
					row = await finishOrLost(pool, params);
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
				log('pg-idempotency: the result could not be stored', err);
				if (!transactional)
					await releaseOrLost(pool, key, token, scope).catch(() => {});
				return unavailable();
			}
			/* what this client sees is what every retry will see, byte for byte */
			const sent = member?.json !== undefined ? Buffer.from(row.json) : body;
			if (sent !== body) {
				delete headers['content-length'];
				delete headers.etag;
			}
			if (cache)
				cache.set(cacheId, requestText, replayResponse({
					headers: JSON.stringify(stored), json: member?.json !== undefined ? row.json : null,
					base64: member?.base64 ?? null, response_code: status,
				}), row.expires_ms);
			return { status, headers, body: sent };
		}

		/* the request died without a response: give the key back */
		async function abandon(err) {
			if (settled)
				return;
			settled = true;
			await heartbeat?.stop();
			if (client) {
				await discard(client);
				client = null;
			} else {
				await releaseOrLost(pool, key, token, scope).catch(() => {});
			}
			log('pg-idempotency: the request ended without a response; key released', err);
		}

		return { action: 'run', context, complete, abandon };
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
				found.headers === claim.headers && found.json === claim.json && found.base64 === claim.base64)
				cache.set(cacheId, requestText, response, found.expires_ms);
		} catch (err) {
			log('pg-idempotency: lookup for the cache failed', err);
		}
	}

	return { begin, cache, retentionHeader, problem };
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

/* the raw request body of a Node request, wherever a parser left it */
async function expressRawBody(req) {
	if (Buffer.isBuffer(req.rawBody))
		return req.rawBody;
	if (typeof req.rawBody === 'string')
		return Buffer.from(req.rawBody);
	if (Buffer.isBuffer(req.body))
		return req.body;
	if (req.complete && !req.readable)
		throw new IdempotencyError('pg-idempotency: the request body was read without keeping ' +
			'its bytes, which the fingerprint needs: pass { verify: rawBody } to the body ' +
			'parser (express.json({ verify: rawBody })), or register the middleware before it');
	/* no parser ran yet: read the body here and keep it for the route */
	req.rawBody = await readStream(req);
	return req.rawBody;
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

/* write a whole response on a Node ServerResponse */
function sendNode(res, response, original = res) {
	res.statusCode = response.status;
	for (const [name, value] of Object.entries(response.headers))
		res.setHeader(name, value);
	if (hasBody(response.status)) {
		res.setHeader('content-length', String(response.body.length));
		original.end.call(res, response.body);
	} else {
		res.removeHeader('content-length');
		original.end.call(res);
	}
}

/* 204 and 304 carry no body, and so no content-length */
function hasBody(status) {
	return status !== 204 && status !== 304;
}

/*
 * expressIdempotency(options): middleware for Express (and plain connect/http
 * style servers).  The route's handler answers as usual (res.status().json(),
 * res.send(buffer), a stream...); the middleware holds the response back until
 * it is stored, then sends what retries will get.  The handler finds the key,
 * token, attempt, and in transactional mode the pg client, on req.idempotency.
 */
function expressIdempotency(options) {
	const engine = createEngine(options);

	function make(transactional) {
		return async function pgIdempotency(req, res, next) {
			let started;
			try {
				started = await engine.begin({
					method: req.method,
					path: req.originalUrl ?? req.url,
					keyLines: keyLinesOf(req.headers, req.headersDistinct),
					rawBody: () => expressRawBody(req),
					original: req,
				}, { transactional });
			} catch (err) {
				return next(err);
			}
			if (started.action === 'pass')
				return next();
			if (started.action === 'respond')
				return sendNode(res, started.response);

			const { context, complete } = started;
			req.idempotency = context;
			const original = { writeHead: res.writeHead, write: res.write, end: res.end };
			const chunks = [];
			let ended = false;
			res.setHeader('idempotency-key-retention', engine.retentionHeader);

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
				complete({ status: res.statusCode, headers: res.getHeaders(), body: Buffer.concat(chunks) })
					.then((response) => {
						res.writeHead = original.writeHead;
						res.write = original.write;
						res.end = original.end;
						for (const name of res.getHeaderNames())
							if (!(name in response.headers))
								res.removeHeader(name);
						sendNode(res, response, original);
					}, (err) => {
						res.writeHead = original.writeHead;
						res.write = original.write;
						res.end = original.end;
						next(err);
					});
				return res;
			};
			return next();
		};
	}

	const middleware = make(false);
	middleware.transactional = make(true);
	middleware.cache = engine.cache;
	return middleware;
}

/* ------------------------------------------------------------------ Fastify */

const ATTEMPT = Symbol('pg-idempotency.attempt');

/*
 * fastifyIdempotency: a Fastify plugin.  It covers every route of the methods
 * option in the context it is registered in (and, with skip-override, that
 * context is the parent's).  Per route: config: { idempotency: false } turns it
 * off, config: { idempotency: { transactional: true } } runs the route in one
 * transaction on request.idempotency.client.
 */
async function fastifyIdempotency(fastify, options) {
	const engine = createEngine(options);
	const methods = new Set((options.methods ?? ['POST', 'PATCH']).map((m) => m.toUpperCase()));

	if (!fastify.hasRequestDecorator('idempotency'))
		fastify.decorateRequest('idempotency', null);

	const routeSetting = (request) => request.routeOptions?.config?.idempotency;

	/* keep the raw bytes for the fingerprint, whatever the content type parser does */
	fastify.addHook('preParsing', async (request, reply, payload) => {
		if (!methods.has(request.method) || routeSetting(request) === false)
			return payload;
		const chunks = [];
		const tee = new Transform({
			transform(chunk, encoding, callback) {
				chunks.push(Buffer.isBuffer(chunk) ? chunk : Buffer.from(chunk, encoding));
				tee.receivedEncodedLength = payload.receivedEncodedLength;
				callback(null, chunk);
			},
			flush(callback) {
				request[RAW_BODY] = Buffer.concat(chunks);
				callback();
			},
		});
		payload.on('error', (err) => tee.destroy(err));
		return payload.pipe(tee);
	});

	/* after validation, so that a request refused by its schema does not use up its key */
	fastify.addHook('preHandler', async (request, reply) => {
		const setting = routeSetting(request);
		if (setting === false)
			return;
		const started = await engine.begin({
			method: request.method,
			path: request.raw.url,
			keyLines: keyLinesOf(request.headers, request.raw.headersDistinct),
			rawBody: async () => request[RAW_BODY] ?? Buffer.alloc(0),
			original: request,
		}, { transactional: setting?.transactional === true });
		if (started.action === 'pass')
			return;
		if (started.action === 'respond') {
			reply.code(started.response.status).headers(started.response.headers);
			return reply.send(hasBody(started.response.status) ? started.response.body : undefined);
		}
		request.idempotency = started.context;
		request[ATTEMPT] = started;
		reply.header('idempotency-key-retention', engine.retentionHeader);
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
		});
		reply.code(response.status);
		for (const name of Object.keys(reply.getHeaders()))
			if (!(name in response.headers))
				reply.removeHeader(name);
		reply.headers(response.headers);
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
	MAX_KEY_LENGTH,
};
