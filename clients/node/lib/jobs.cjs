'use strict';
/*
 * Idempotent jobs and queue consumers: idempotent(pool, options, fn),
 * idempotentJob(pool, options, fn) and currentJob().  A claimed key runs fn
 * while a heartbeat keeps its lease; the return value is stored, an error
 * that retryable(err) accepts releases the key for the next delivery, any
 * other error is stored as the key's failure.  A session-bound claim holds
 * its pool connection until the attempt settles.  A key whose result has
 * expired but which the server remembers throws ExpiredError: the work ran.
 * With keepRequest the claim stores the request with the key, so that a
 * completer (completer.cjs) can finish the key if this process dies; the
 * completer runs taken-over keys through runClaimed() here, so that fn sees
 * the same attempt in both.
 */

const { AsyncLocalStorage } = require('node:async_hooks');
const {
	IdempotencyError, InProgressError, MismatchError, ExpiredError, StoredFailureError, KeyLostError,
} = require('./errors.cjs');
const {
	DEFAULT_LEASE, DEFAULT_RETENTION, RECOVERY_EXTENSION_VERSION, claimStatement,
	requireVersion, poolInfo, seconds, positiveSeconds, rememberSeconds, requireRemember, keepRequestOption,
	requireKeepRequest, toJsonText, startHeartbeat, defaultLog, makeHooks, phaseDataOf, makeCheckpoint,
	releaseOrLost, finishOrLost,
} = require('./core.cjs');

/*
 * A pg.Pool (or a wrapper of one): connect() hands out a client of its own.
 * A pg.Client has connect() too, but it connects that very client.
 */
function isPool(db) {
	return typeof db.connect === 'function' && !('processID' in db);
}

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
	const remember = rememberSeconds(options.remember);
	const retryable = options.retryable ?? (() => true);
	const log = options.log ?? defaultLog;
	const request = options.request === undefined ? null : toJsonText(options.request, 'request');
	if (options.sessionBound !== undefined && typeof options.sessionBound !== 'boolean')
		throw new TypeError(`options.sessionBound must be a boolean, got ${String(options.sessionBound)}`);
	const sessionBound = options.sessionBound === true;
	const keepRequest = keepRequestOption(options.keepRequest);
	const { sql: claimSql, params } = claimStatement({
		key, request, scope, lease, retention, wait, sessionBound, remember, keepRequest,
	});
	const hooks = makeHooks(options, log);
	const event = { key, scope, request: options.request ?? null };
	/* the application's own error (fn threw it), which onError does not report */
	const seen = { user: undefined };
	/* what runClaimed needs besides the extension's info; fn gets the request as given */
	const running = { key, scope, request: event.request, lease, retention, remember, retryable, log, seen };
	try {
		return await claimAndRun();
	} catch (err) {
		if (err !== seen.user && !(err instanceof InProgressError) && !(err instanceof MismatchError) &&
			!(err instanceof ExpiredError) && !(err instanceof StoredFailureError))
			hooks.error({ ...event, error: err });
		throw err;
	}

	/* the claim's outcome, told to the application's hooks */
	function announce(claim) {
		if (claim.outcome === 'claimed')
			hooks.claim({ ...event, token: claim.token, attempt: claim.attempt });
		else if (claim.outcome === 'replay')
			hooks.replay({ ...event, status: claim.status });
		else if (claim.outcome === 'in_progress')
			hooks.conflict({ ...event, retryAfter: Number(claim.retry_after ?? 1) });
		else if (claim.outcome === 'mismatch')
			hooks.mismatch(event);
		else if (claim.outcome === 'expired')
			hooks.expired({ ...event, status: claim.status, responseCode: claim.response_code });
	}

	async function claimAndRun() {
		const info = await poolInfo(pool, log);
		if (sessionBound)
			requireVersion(info, RECOVERY_EXTENSION_VERSION, ' (sessionBound)');
		requireRemember(info, remember);
		requireKeepRequest(info, keepRequest);

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
				claim = (await held.query(claimSql, params)).rows[0];
			} catch (err) {
				/* a connection error (no SQLSTATE) retires the client; a refused claim does not */
				if (err?.code === undefined)
					heldError = err;
				giveBack();
				throw err;
			}
			announce(claim);
			if (claim.outcome === 'claimed') {
				try {
					return await runClaimed(pool, claim, { ...running, info }, fn);
				} finally {
					giveBack();
				}
			}
			giveBack();
		} else {
			claim = (await pool.query(claimSql, params)).rows[0];
			announce(claim);
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
			case 'expired':
				throw new ExpiredError(key, { scope, status: claim.status, responseCode: claim.response_code });
			case 'claimed':
				return runClaimed(pool, claim, { ...running, info }, fn);
			default:
				throw new IdempotencyError(`unexpected claim outcome ${claim.outcome}`);
		}
	}
}

/*
 * A job's value as the finish stores it: {"v":1,"json":value}, succeeded, no
 * response code (no value is JSON null, as the Python library stores None).
 */
function jobResult(value) {
	return {
		envelope: `{"v":1,"json":${value === undefined ? 'null' : toJsonText(value, 'the return value')}}`,
		status: 'succeeded',
		code: null,
	};
}

/*
 * Run fn for a claimed key, keep its lease alive, then store its result or
 * give the key back.  claim: the claimed row (token, attempt, phase,
 * phase_data); request: the job's payload, handed to fn.  result(value)
 * turns fn's value into what the finish stores ({ envelope, status, code }),
 * or null to release the key instead; settled(how, err) hears 'succeeded',
 * 'failed' or 'released' once the key is settled, with fn's error if it
 * threw.  retention and remember
 * null: not sent (the claim's apply).
 */
async function runClaimed(pool, claim, {
	key, scope, request = null, lease, retention, remember, retryable, log, info, seen,
	result = jobResult, settled = () => {},
}, fn) {
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
	/* the finish's parameters: remember only when set */
	const finishParams = (envelope, status, code = null) =>
		[key, token, code, envelope, scope, status, retention, ...(remember === null ? [] : [remember])];

	let value;
	try {
		value = await fn({
			key, scope, token, attempt, request, signal: controller.signal,
			phase: claim.phase ?? null, phaseData: phaseDataOf(claim), checkpoint,
		});
	} catch (err) {
		await heartbeat.stop();
		if (lost)
			throw err instanceof KeyLostError ? err : new KeyLostError(key, { cause: err });
		if (seen)
			seen.user = err;
		if (retryable(err)) {
			await releaseOrLost(pool, key, token, scope, err);
			settled('released', err);
			throw err;
		}
		const envelope = JSON.stringify({
			v: 1,
			error: { name: String(err?.name ?? 'Error'), message: String(err?.message ?? err) },
		});
		await finishOrLost(pool, finishParams(envelope, 'failed'), err);
		settled('failed', err);
		throw err;
	}
	await heartbeat.stop();
	if (lost)
		throw new KeyLostError(key);

	let stored;
	try {
		stored = result(value);
	} catch (err) {
		if (seen)
			seen.user = err;
		await releaseOrLost(pool, key, token, scope, err);
		settled('released', err);
		throw err;
	}
	if (stored === null) {
		await releaseOrLost(pool, key, token, scope);
		settled('released');
	} else {
		await finishOrLost(pool, finishParams(stored.envelope, stored.status, stored.code));
		settled(stored.status);
	}
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

/* run fn with `attempt` as currentJob() (a completer's handler, as an idempotentJob's fn) */
function asCurrentJob(attempt, fn) {
	return jobs.run(attempt, fn);
}

/* a job's stored value: json, the bytes of base64, or undefined for none (an older {"v":1}) */
function storedValue(claim) {
	if (claim.json !== null)
		return JSON.parse(claim.json);
	if (claim.base64 !== null)
		return Buffer.from(claim.base64, 'base64');
	return undefined;
}

module.exports = { idempotent, idempotentJob, currentJob, runClaimed, asCurrentJob };
