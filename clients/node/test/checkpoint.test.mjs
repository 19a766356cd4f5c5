// Recovery points (checkpoint, phase, phaseData) and session-bound claims
// (sessionBound), for jobs and for the HTTP middleware, against a real PostgreSQL.
import { test, after, before } from 'node:test';
import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import pg from 'pg';
import express from 'express';
import { idempotent, expressIdempotency, rawBody, KeyLostError, MisconfiguredError } from 'pg-idempotency';
import { db, newKey, deferred, waitFor, send } from './helpers.mjs';

const pool = new pg.Pool({ max: 6 });

before(async () => {
	await db.query('CREATE TABLE IF NOT EXISTS steps_node (key text, step text)');
});

after(async () => {
	await pool.end();
	await db.end();
});

/** (phase, phase_data) as stored; null when the key is absent. */
async function checkpointOf(key, scope = '', on = db) {
	const { rows } = await on.query(
		'SELECT phase, phase_data FROM idempotency.keys WHERE key = $1 AND scope = $2', [key, scope]);
	return rows[0] ?? null;
}

async function stepsOf(key) {
	const { rows } = await db.query('SELECT step FROM steps_node WHERE key = $1 ORDER BY step', [key]);
	return rows.map((r) => r.step);
}

/** End the current attempt's lease now, as if it had died: the next claim takes the key over. */
async function endLease(key, scope = '') {
	await db.query(`UPDATE idempotency.keys SET lease_until = clock_timestamp() - interval '1 second'
	                 WHERE key = $1 AND scope = $2`, [key, scope]);
}

/** A plain SQL claim: { outcome, attempt, token, phase, phase_data }. */
async function claimSql(key) {
	const { rows } = await db.query(
		`SELECT outcome, attempt, token::text AS token, phase, phase_data
		   FROM idempotency.idem_claim(key => $1, lease => '1 hour')`, [key]);
	return rows[0];
}

/** A checksum of a key's row, to show that a refused call changed nothing. */
async function rowSum(key) {
	const { rows } = await db.query(
		`SELECT count(*)::int AS n, md5(string_agg(k::text, ',')) AS sum
		   FROM idempotency.keys k WHERE key = $1`, [key]);
	return rows[0];
}

// ------------------------------------------------------------ recovery points

test('a checkpoint is stored at once and handed to the attempt that takes over', async () => {
	const key = newKey('cp');
	const seen = [];
	const first = idempotent(pool, { key, scope: 'shop', request: { order: 1 }, lease: 60 },
		async ({ attempt, token, phase, phaseData, checkpoint }) => {
			seen.push({ attempt, phase, phaseData });
			await checkpoint('reserved');
			assert.deepEqual(await checkpointOf(key, 'shop'), { phase: 'reserved', phase_data: null });
			await checkpoint('charge_created', { charge: 'ch_1', amount: 1250 });
			assert.deepEqual(await checkpointOf(key, 'shop'),
				{ phase: 'charge_created', phase_data: { charge: 'ch_1', amount: 1250 } });

			await endLease(key, 'shop');                 // this attempt "dies" here
			const second = await idempotent(pool, { key, scope: 'shop', request: { order: 1 } },
				async (a) => {
					seen.push({ attempt: a.attempt, phase: a.phase, phaseData: a.phaseData });
					assert.ok(BigInt(a.token) > BigInt(token));
					return { shipped: a.phaseData.charge };
				});
			assert.equal(second.attempt, 2);
			return 'too late';
		});
	await assert.rejects(first, KeyLostError);
	assert.deepEqual(seen, [
		{ attempt: 1, phase: null, phaseData: null },
		{ attempt: 2, phase: 'charge_created', phaseData: { charge: 'ch_1', amount: 1250 } },
	]);
	const { rows } = await db.query(
		`SELECT status, attempt, phase, response_body FROM idempotency.idem_lookup($1, 'shop')`, [key]);
	assert.deepEqual(rows[0], {
		status: 'succeeded', attempt: 2, phase: 'charge_created',    // finish keeps the phase
		response_body: { v: 1, json: { shipped: 'ch_1' } },
	});
});

test('checkpoint on a client: it commits with the step, or rolls back with it', async () => {
	const key = newKey('cp-client');
	const done = await idempotent(pool, { key, lease: 60 }, async ({ checkpoint }) => {
		const client = await pool.connect();
		try {
			await client.query('BEGIN');
			await client.query(`INSERT INTO steps_node VALUES ($1, 'charge')`, [key]);
			await checkpoint('charge_created', { charge: 'ch_2' }, { client });
			assert.deepEqual(await checkpointOf(key, '', client),
				{ phase: 'charge_created', phase_data: { charge: 'ch_2' } });
			assert.deepEqual(await checkpointOf(key), { phase: null, phase_data: null }, 'not before COMMIT');
			await client.query('ROLLBACK');
			assert.deepEqual(await checkpointOf(key), { phase: null, phase_data: null });
			assert.deepEqual(await stepsOf(key), []);

			await client.query('BEGIN');
			await client.query(`INSERT INTO steps_node VALUES ($1, 'charge')`, [key]);
			await checkpoint('charge_created', { charge: 'ch_3' }, { client });
			await client.query('COMMIT');
		} finally {
			client.release();
		}
		assert.deepEqual(await checkpointOf(key), { phase: 'charge_created', phase_data: { charge: 'ch_3' } });
		assert.deepEqual(await stepsOf(key), ['charge']);
		return 'shipped';
	});
	assert.equal(done.value, 'shipped');
});

for (const [then, code] of [[null, '55006'], ['finish', '55000'], ['release', 'P0002']]) {
	test(`a checkpoint with a stale token throws KeyLostError (${code}), aborts the signal, changes nothing`, async () => {
		const key = newKey('cp-stale');
		let inner;
		const job = idempotent(pool, { key, lease: 60 }, async ({ checkpoint, signal }) => {
			await checkpoint('mine', { n: 1 });
			await endLease(key);
			const taken = await claimSql(key);
			assert.deepEqual([taken.outcome, taken.attempt, taken.phase], ['claimed', 2, 'mine']);
			if (then === 'finish')
				await db.query('SELECT idempotency.idem_finish($1, $2::bigint)', [key, taken.token]);
			else if (then === 'release')
				await db.query('SELECT idempotency.idem_release($1, $2::bigint)', [key, taken.token]);
			const before = await rowSum(key);
			inner = await checkpoint('too_late', { n: 2 }).catch((e) => e);
			assert.ok(inner instanceof KeyLostError, String(inner));
			assert.equal(inner.cause.code, code);
			assert.ok(signal.aborted);
			assert.equal(signal.reason, inner);
			assert.deepEqual(await rowSum(key), before, "the new owner's row is untouched");
			return 'ignored the loss';
		});
		await assert.rejects(job, KeyLostError);
	});
}

test('checkpoint argument errors: TypeError before any statement; the server judges the rest', async () => {
	const key = newKey('cp-bad');
	await idempotent(pool, { key }, async ({ checkpoint }) => {
		await assert.rejects(checkpoint(42), TypeError);
		await assert.rejects(checkpoint('x', { big: 1n }), TypeError);
		const before = await rowSum(key);
		await assert.rejects(checkpoint(''), (e) => e.code === '22023');
		await assert.rejects(checkpoint('p'.repeat(256)), (e) => e.code === '22001');
		assert.deepEqual(await rowSum(key), before);
		return 1;
	});
	assert.deepEqual(await checkpointOf(key), { phase: null, phase_data: null });
	await assert.rejects(idempotent(pool, { key: newKey(), sessionBound: 'yes' }, async () => 1), TypeError);
});

// -------------------------------------------------------------- HTTP middleware

async function startApp(options) {
	const app = express();
	app.use(express.json({ verify: rawBody }));
	const idem = expressIdempotency({ pool, lease: 60, ...options });
	const seen = [];
	const gate = { entered: deferred(), release: deferred() };
	app.post('/tx', idem.transactional, async (req, res) => {
		const { key, client, checkpoint, phase } = req.idempotency;
		seen.push({ phase });
		await client.query(`INSERT INTO steps_node VALUES ($1, 'a')`, [key]);
		await checkpoint('a_done', { a: 1 });          // in the request's transaction
		if (req.body.fail)
			throw new Error('fail after the checkpoint');
		res.status(201).json({ ok: true });
	});
	app.post('/steps', idem, async (req, res) => {
		const { key, attempt, phase, phaseData, checkpoint } = req.idempotency;
		seen.push({ attempt, phase, phaseData });
		if (phase === null) {
			await checkpoint('charge_created', { charge: `ch_${key}` });
			if (req.body.stall) {
				await endLease(key);                   // as good as dead after the charge
				gate.entered.resolve();
				await gate.release.promise;
			}
		}
		res.status(201).json({ shipped: (phaseData ?? { charge: `ch_${key}` }).charge });
	});
	const server = await new Promise((resolve) => {
		const s = app.listen(0, '127.0.0.1', () => resolve(s));
	});
	return {
		url: `http://127.0.0.1:${server.address().port}`,
		seen,
		gate,
		close: () => new Promise((r) => { server.closeAllConnections(); server.close(r); }),
	};
}

test('HTTP: a checkpoint in the transactional mode commits or rolls back with the request', async () => {
	const logs = [];
	const app = await startApp({ log: (m) => logs.push(m) });
	try {
		const failed = newKey('tx-fail');
		const r1 = await send(app.url, '/tx', { key: failed, body: '{"fail": true}' });
		assert.equal(r1.status, 500);
		assert.equal(await checkpointOf(failed), null, 'no key, no checkpoint');
		assert.deepEqual(await stepsOf(failed), []);

		const ok = newKey('tx-ok');
		const r2 = await send(app.url, '/tx', { key: ok, body: '{}' });
		assert.equal(r2.status, 201, r2.text);
		assert.deepEqual(await checkpointOf(ok), { phase: 'a_done', phase_data: { a: 1 } });
		assert.deepEqual(await stepsOf(ok), ['a']);
		assert.deepEqual(app.seen, [{ phase: null }, { phase: null }]);
	} finally {
		await app.close();
	}
});

test('HTTP: the request that takes a key over sees the last checkpoint in req.idempotency', async () => {
	const app = await startApp({});
	try {
		const key = newKey('steps');
		const first = send(app.url, '/steps', { key, body: '{"stall": true}' });
		await app.gate.entered.promise;
		const second = await send(app.url, '/steps', { key, body: '{"stall": true}' });
		assert.equal(second.status, 201, second.text);
		assert.deepEqual(JSON.parse(second.text), { shipped: `ch_${key}` });
		assert.deepEqual(app.seen, [
			{ attempt: 1, phase: null, phaseData: null },
			{ attempt: 2, phase: 'charge_created', phaseData: { charge: `ch_${key}` } },
		]);
		app.gate.release.resolve();
		const stale = await first;
		assert.equal(stale.status, 409);
		assert.match(JSON.parse(stale.text).type, /idempotency-key-lost$/);
	} finally {
		await app.close();
	}
});

// ------------------------------------------------------------ session-bound claims

async function ownerSession(key) {
	const { rows } = await db.query('SELECT owner_session::text FROM idempotency.keys WHERE key = $1', [key]);
	return rows[0]?.owner_session;
}

/** The backend of the idle session whose last statement was a session-bound claim. */
async function claimBackend() {
	const { rows } = await db.query(
		`SELECT pid FROM pg_stat_activity
		  WHERE datname = current_database() AND state = 'idle'
		    AND query LIKE '%session_bound => true%' AND pid <> pg_backend_pid()`);
	assert.equal(rows.length, 1, JSON.stringify(rows));
	return rows[0].pid;
}

test('a plain claim is not session-bound', async () => {
	const key = newKey('plain');
	await idempotent(pool, { key }, async () => {
		assert.equal(await ownerSession(key), null);
	});
});

test('sessionBound: the claim holds its pool client until the attempt settles', async () => {
	const own = new pg.Pool({ max: 2 });
	try {
		const key = newKey('bound');
		await idempotent(own, { key, sessionBound: true, lease: 3600 }, async ({ checkpoint }) => {
			assert.notEqual(await ownerSession(key), null);
			assert.equal(own.totalCount - own.idleCount, 1, 'one client held by the claim');
			await checkpoint('half_way');                // on the pool's other client
			return 'bound';
		});
		assert.equal(own.totalCount - own.idleCount, 0, 'and given back');
		const { rows } = await db.query('SELECT status, phase FROM idempotency.idem_lookup($1)', [key]);
		assert.deepEqual(rows[0], { status: 'succeeded', phase: 'half_way' });

		// a replay holds nothing
		const again = await idempotent(own, { key, sessionBound: true }, async () => 'twice');
		assert.equal(again.replayed, true);
		assert.equal(own.totalCount - own.idleCount, 0);
	} finally {
		await own.end();
	}
});

test('sessionBound: when the claim\'s session ends, the key is taken over at once, lease or not', async () => {
	const own = new pg.Pool({ max: 2 });
	const logs = [];
	try {
		const key = newKey('orphan');
		const job = idempotent(own, { key, sessionBound: true, lease: 3600, log: (m) => logs.push(m) },
			async ({ checkpoint, signal }) => {
				await checkpoint('charge_created', { charge: 'ch_7' });
				await db.query('SELECT pg_terminate_backend($1)', [await claimBackend()]);
				const taken = await waitFor(async () => {
					const c = await claimSql(key);
					return c.outcome === 'claimed' ? c : null;
				}, 'the takeover of the orphaned key');
				assert.equal(taken.attempt, 2);
				assert.equal(taken.phase, 'charge_created');
				assert.deepEqual(taken.phase_data, { charge: 'ch_7' });
				assert.equal(signal.aborted, false, 'nothing told this attempt yet');
				await waitFor(() => logs.some((m) => /session-bound claim failed/.test(m)),
					'the held client to see its session end');
				return 'too late';
			});
		await assert.rejects(job, KeyLostError);
		const { rows } = await db.query('SELECT status, attempt FROM idempotency.keys WHERE key = $1', [key]);
		assert.deepEqual(rows[0], { status: 'pending', attempt: 2 });
	} finally {
		await own.end();
	}
});

test('sessionBound on a pg.Client: bound to that client\'s session', async () => {
	const client = new pg.Client();
	await client.connect();
	try {
		const key = newKey('bound-client');
		const done = await idempotent(client, { key, sessionBound: true }, async () => ownerSession(key));
		assert.notEqual(done.value, null);
	} finally {
		await client.end();
	}
});

// ------------------------------------------------------ extension versions before 1.4

test('jobs work on extension 1.3; the 1.4 calls say which version they need', async () => {
	const name = `idem_node_v13_${randomUUID().slice(0, 8)}`;
	await db.query(`CREATE DATABASE ${name}`);
	const old = new pg.Pool({ database: name, max: 2 });
	try {
		await old.query(`CREATE EXTENSION idempotency VERSION '1.3'`);
		const key = newKey('v13');
		const first = await idempotent(old, { key }, async ({ attempt, phase, phaseData }) => ({ attempt, phase, phaseData }));
		assert.deepEqual(first.value, { attempt: 1, phase: null, phaseData: null });
		assert.equal((await idempotent(old, { key }, async () => 'again')).replayed, true);
		const needs = (what) => (e) => e instanceof MisconfiguredError &&
			e.message.includes(`(${what}) needs the idempotency extension 1.4 or later`) &&
			e.message.includes(`database "${name}" has 1.3`);
		const unclaimed = newKey();
		await assert.rejects(idempotent(old, { key: unclaimed, sessionBound: true }, async () => 1),
			needs('sessionBound'));
		// refused before the claim: the key was never taken
		assert.equal((await old.query('SELECT count(*)::int AS n FROM idempotency.keys WHERE key = $1',
			[unclaimed])).rows[0].n, 0);
		let ran = 0;
		await assert.rejects(idempotent(old, { key: newKey() }, async ({ checkpoint }) => {
			ran += 1;
			await checkpoint('x');
		}), needs('checkpoint()'));
		assert.equal(ran, 1);
	} finally {
		await old.end();
		// a client the pool let go of may still be closing: drop once all are gone
		await waitFor(async () => (await db.query(
			'SELECT count(*)::int AS n FROM pg_stat_activity WHERE datname = $1', [name])).rows[0].n === 0,
		'the old database\'s sessions to end');
		await db.query(`DROP DATABASE ${name}`);
	}
});
