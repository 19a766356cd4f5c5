
# Copyright: the idempotency extension authors.
#
# 216_completer_crash.pl: completers finish what killed workers leave, under
# load, across a crash.
#
# $N jobs (keys job-1 .. job-N of scope "jobs"), each a claim with its
# request kept and a two-second lease, then two steps, each one transaction
# of a business write (a row in public.ledger that carries the key, the
# step and the fencing token) and the key's call: step 1 with
# idem_checkpoint('step-1'), step 2 with idem_finish.  So a step's write
# commits exactly when its checkpoint or finish does, and only under the
# key's current token.
#
# Workers: four psql sessions, driven one statement at a time by this file
# in turn, so that several jobs are in flight at once, some of them idle in
# a transaction.  Before the run every job gets, from a fixed seed, the
# point where its worker is killed, if it is (after the claim, after step
# 1's write, after its checkpoint, after its commit, after step 2's write,
# after the finish before its commit), whether the client retries the job
# after that (idem_claim again with the same request: claimed, resuming from
# the phase it returns, or in_progress or replay, and then it leaves the job
# alone), and how soon.  A kill is pg_terminate_backend of the worker's
# backend, waited for until the backend is gone; a new session replaces it.
# Once, at a job drawn from the same seed, the whole server goes down
# (immediate shutdown: every session dies with it, in whatever transaction
# it was) and starts again through crash recovery.
#
# Completers: two sessions run public.complete(), a loop of
# idem_claim_abandoned('jobs', 4, lease 3 s): each key it takes is driven
# from the phase it returns to the end with the token it returns, each step
# as the workers do it; when nothing is abandoned it looks again 200 ms
# later.  A worker's or completer's step whose call raises 55006 (its token
# is dead), 55P03 (another transaction is taking the key over or resetting
# it) or 55000 (another token finished the key) is rolled back and the key
# left to whoever has it now.  A third session
# sweeps (idem_sweep every 100 ms), so some abandoned keys are reset first
# and found through the reset.  Every claim that takes a key, a worker's or
# a completer's, records (key, token, attempt) in public.takes in the same
# transaction.  The loops end when every job has succeeded.
#
# Nothing is timed: the kill points come from the seed, and every wait
# polls a condition (a backend gone, every key finished, a loop ended).
# Which claims race which is up to the machine; what must hold is not:
#   - every job is one stored key, succeeded, its kept request gone;
#   - every step ran exactly once per key (one ledger row each);
#   - no token was handed out twice, a key's tokens grow with its attempts,
#     the tokens after the crash are larger than every one before it, and
#     every ledger row carries a token its key was claimed with, step 2's
#     no smaller than step 1's;
#   - a key's attempt is the number of its takeovers + 1: its takes are
#     attempts 1 .. attempt, one each;
#   - the stored token and the finished response are those of step 2's
#     writer;
#   - each completer's takeover returned the key's kept request and a phase
#     that matched the ledger at that moment;
#   - every job whose worker was killed and not retried was finished by a
#     completer, and steps 1 and 2 of a job killed after step 1 committed
#     carry different tokens;
#   - no call failed with any other SQLSTATE;
#   - the indexes of idempotency.keys pass amcheck after the crash
#     recovery;
#   - after the restart, the sweeps that reset keys sent one
#     idempotency_abandoned notification each, with payload "jobs";
#   - (C edition) the counters since the restart: abandoned_takeovers is
#     the completers' takes, takeovers every take with attempt > 1.
#
# IDEM_COMPLETER_JOBS sets N (default 200).  Run as described at the top
# of t/001_restart.pl.  Port 55516 only names the socket file.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(usleep);

srand(216);

my $N          = $ENV{IDEM_COMPLETER_JOBS} // 200;
my $WORKERS    = 4;
my $COMPLETERS = 2;
my @KILL_POINTS = qw(claim l1 c1 k1 l2 f2);

# The sweeps are this file's (public.sweep_loop): no background worker.
my $node = new_node('completer_crash', port => 55516,
	conf => [ 'idempotency.sweep_interval = 0', 'max_connections = 40' ],
	extension => 1);

sub sql { return $node->safe_psql('postgres', $_[0]); }

sql(<<"EOS");
CREATE TABLE public.jobs (key text PRIMARY KEY, request jsonb NOT NULL);
INSERT INTO public.jobs
SELECT 'job-' || i, jsonb_build_object('job', i, 'amount', i * 100)
  FROM generate_series(1, $N) i;
-- every claim that took a key: the worker's or completer's, in the claim's
-- transaction; epoch tells the server's lives apart
CREATE TABLE public.takes (key text NOT NULL, token bigint NOT NULL, attempt int NOT NULL,
	who text NOT NULL, epoch timestamptz NOT NULL DEFAULT pg_postmaster_start_time());
-- the business side: one row per step run
CREATE TABLE public.ledger (key text NOT NULL, step text NOT NULL, token bigint NOT NULL,
	who text NOT NULL);
-- a completer's step refused because the key is someone else's now
CREATE TABLE public.losses (who text, key text, step text, sqlstate text);
-- what must not happen, as a completer saw it
CREATE TABLE public.anomalies (who text, key text, what text);
CREATE TABLE public.sweeps (reset bigint NOT NULL,
	epoch timestamptz NOT NULL DEFAULT pg_postmaster_start_time());
CREATE TYPE public.take AS (key text, token bigint, attempt int, request jsonb, phase text);

CREATE FUNCTION public.all_done() RETURNS boolean LANGUAGE sql AS \$\$
	SELECT count(*) = $N FROM idempotency.keys WHERE scope = 'jobs' AND status = 'succeeded'
\$\$;

-- One step of key t with token t.token, as one subtransaction: the ledger
-- row and the key's call (the checkpoint of step 1, the finish of step 2).
-- False when the call was refused because the key is someone else's now:
-- its token is dead (55006), another transaction is taking the key over or
-- resetting it (55P03), or another token finished it (55000).
CREATE FUNCTION public.run_step(me text, t public.take, step text) RETURNS boolean
LANGUAGE plpgsql AS \$\$
BEGIN
	INSERT INTO public.ledger VALUES (t.key, step, t.token, me);
	IF step = 'step-1' THEN
		PERFORM idempotency.idem_checkpoint(t.key, t.token, 'step-1',
			jsonb_build_object('by', me), 'jobs');
	ELSE
		PERFORM idempotency.idem_finish(t.key, t.token, 200,
			jsonb_build_object('token', t.token, 'by', me), 'jobs');
	END IF;
	RETURN true;
EXCEPTION WHEN OTHERS THEN
	IF SQLSTATE IN ('55006', '55P03', '55000') THEN
		INSERT INTO public.losses VALUES (me, t.key, step, SQLSTATE);
	ELSE
		INSERT INTO public.anomalies VALUES (me, t.key,
			step || ' raised ' || SQLSTATE || ': ' || SQLERRM);
	END IF;
	RETURN false;
END \$\$;

-- A completer: take up to 4 abandoned jobs at a time and drive each from
-- its phase to the end, a transaction per step; until every job succeeded.
CREATE PROCEDURE public.complete(me text) LANGUAGE plpgsql AS \$\$
DECLARE
	got public.take[];
	t public.take;
	deadline timestamptz := clock_timestamp() + interval '150 seconds';
BEGIN
	LOOP
		WITH c AS (SELECT * FROM idempotency.idem_claim_abandoned('jobs', 4, '3 seconds')),
			 i AS (INSERT INTO public.takes (key, token, attempt, who)
				   SELECT c.key, c.token, c.attempt, me FROM c)
		SELECT coalesce(array_agg(ROW(c.key, c.token, c.attempt, c.request, c.phase)::public.take),
						'{}')
		  INTO got FROM c;
		-- what the takeover returned against what is committed: the kept
		-- request, and the phase against the ledger (a step's row and its
		-- checkpoint commit together; step 2 finishes the key)
		FOREACH t IN ARRAY got LOOP
			IF t.request IS DISTINCT FROM (SELECT request FROM public.jobs WHERE key = t.key) THEN
				INSERT INTO public.anomalies VALUES (me, t.key,
					'takeover returned request ' || coalesce(t.request::text, 'NULL'));
			END IF;
			IF (t.phase IS NOT DISTINCT FROM 'step-1') IS DISTINCT FROM
				   EXISTS (SELECT FROM public.ledger WHERE key = t.key AND step = 'step-1')
			   OR t.phase IS DISTINCT FROM NULL AND t.phase IS DISTINCT FROM 'step-1'
			   OR EXISTS (SELECT FROM public.ledger WHERE key = t.key AND step = 'step-2') THEN
				INSERT INTO public.anomalies VALUES (me, t.key,
					'takeover returned phase ' || coalesce(t.phase, 'NULL')
					|| ', ledger has ' || (SELECT coalesce(string_agg(step, ',' ORDER BY step), 'nothing')
											 FROM public.ledger WHERE key = t.key));
			END IF;
		END LOOP;
		COMMIT;
		IF cardinality(got) = 0 THEN
			EXIT WHEN public.all_done();
			IF clock_timestamp() > deadline THEN
				INSERT INTO public.anomalies VALUES (me, NULL, 'gave up: jobs left unfinished');
				COMMIT;
				EXIT;
			END IF;
			PERFORM pg_sleep(0.2);
			CONTINUE;
		END IF;
		FOREACH t IN ARRAY got LOOP
			IF t.phase IS NULL THEN
				IF NOT public.run_step(me, t, 'step-1') THEN
					COMMIT;
					CONTINUE;
				END IF;
				COMMIT;
			END IF;
			PERFORM public.run_step(me, t, 'step-2');
			COMMIT;
		END LOOP;
	END LOOP;
END \$\$;

-- The sweeper: idem_sweep every 100 ms, each call its own transaction,
-- until every job succeeded.
CREATE PROCEDURE public.sweep_loop() LANGUAGE plpgsql AS \$\$
DECLARE
	deadline timestamptz := clock_timestamp() + interval '150 seconds';
BEGIN
	LOOP
		INSERT INTO public.sweeps (reset) SELECT s.reset FROM idempotency.idem_sweep() s;
		COMMIT;
		EXIT WHEN public.all_done() OR clock_timestamp() > deadline;
		PERFORM pg_sleep(0.1);
	END LOOP;
END \$\$;
EOS

###############################################################################
# The plan, all drawn from the seed before anything runs
###############################################################################

# Per job and client attempt (0: the first, 1 and 2: retries): where its
# worker is killed ('' = not), whether the client retries after a kill, and
# how many jobs later the retry starts.
my %plan;
foreach my $i (1 .. $N)
{
	foreach my $a (0 .. 2)
	{
		$plan{"job-$i"}[$a] = {
			kill  => rand() < 0.35 ? $KILL_POINTS[ int(rand(@KILL_POINTS)) ] : '',
			retry => rand() < 0.5,
			delay => $WORKERS + int(rand($WORKERS * 8)),
		};
	}
}
my $crash_at = 'job-' . int($N * 0.4 + rand($N * 0.2));

###############################################################################
# Sessions
###############################################################################

my $ctl;           # the test's own session: kills and polls
my @workers;
my @completers;
my ($sweeper, $listener);
my $generation = 0;

# A psql session that stops at nothing (its errors are read from stderr),
# with SQLSTATEs in its messages; its backend's pid.
sub session
{
	my $s = $node->background_psql('postgres', on_error_stop => 0, timeout => 600);
	$s->set_query_timer_restart;
	$s->query_safe('\set VERBOSITY verbose');
	my $pid = $s->query_safe('SELECT pg_backend_pid()');
	return ($s, $pid);
}

# Run $sql in session $s: (its output, the SQLSTATE it raised or undef).
# Anything else on stderr is returned as the "SQLSTATE" so that it fails.
sub run
{
	my ($s, $sql) = @_;
	my ($out) = $s->query($sql);
	my $err = $s->{stderr};
	$s->{stderr} = '';
	return ($out, undef) if $err eq '';
	return ($out, $err =~ /ERROR:\s+([0-9A-Z]{5}):/ ? $1 : "unexpected output: $err");
}

# End a psql process whose server session is gone or going.
sub discard
{
	my ($s) = @_;
	eval { $s->{run}->kill_kill; };
	eval { $s->{run}->finish; };
}

# A worker in slot $slot: a new session, named for the ledger by its slot
# and the sessions started so far.
sub new_worker
{
	my ($slot) = @_;
	my ($s, $pid) = session();
	$generation++;
	return { s => $s, pid => $pid, name => "w$slot.$generation", slot => $slot, job => undef };
}

# A session that runs CALL $call in the background and prints $done when
# it returns.
sub start_loop
{
	my ($call, $done) = @_;
	my ($s, $pid) = session();
	$s->{stdin} .= "CALL $call;\n\\echo $done\n";
	$s->{run}->pump_nb;
	return { s => $s, pid => $pid, done => $done };
}

# Until the loop session $l has printed its end line.
sub wait_loop
{
	my ($l) = @_;
	my $ok = pump_until($l->{s}{run}, $l->{s}{timeout}, \$l->{s}{stdout}, qr/$l->{done}/);
	my $err = $l->{s}{stderr};
	$l->{s}->quit;
	return ($ok, $err);
}

my %notified;    # payload => notifications the listener got since the restart

# The notifications the listener has received, counted into %notified.
sub read_notifications
{
	my ($out) = run($listener, 'SELECT 1');
	$notified{$1}++
	  while $out =~ /Asynchronous notification "idempotency_abandoned" with payload "([^"]*)"/g;
}

# The sessions of one life of the server: the test's own, the listener
# (listen => 1), the sweeper, the completers (named c<n>.<life>) and the
# workers.  The listener is first, so that it hears every sweep after it.
sub start_everything
{
	my (%opt) = @_;
	($ctl) = session();
	if ($opt{listen})
	{
		($listener) = session();
		my (undef, $err) = run($listener, 'LISTEN idempotency_abandoned');
		die "LISTEN failed: $err" if $err;
	}
	$sweeper = start_loop('public.sweep_loop()', 'sweeper-done');
	@completers =
	  map { start_loop("public.complete('c$_.$opt{life}')", "completer-$_-done") }
	  1 .. $COMPLETERS;
	@workers = map { new_worker($_) } 1 .. $WORKERS;
}

###############################################################################
# The workers, driven from here
###############################################################################

my @queue = map { { key => "job-$_", a => 0 } } 1 .. $N;
my (%kills, %outcomes, %lost, @unexpected, %left_to_completers, %resumable);
my $crashed = 0;

# The job $j was cut off by a kill or the crash: the client retries it
# later if its plan says so, else it is left to the completers.
sub after_kill
{
	my ($j) = @_;
	my $p = $plan{ $j->{key} }[ $j->{a} ];
	# step 1 committed: whoever does step 2 does it with another token
	$resumable{ $j->{key} } = 1 if $j->{step1_done};
	if ($p->{retry} && $j->{a} < 2)
	{
		my $at = $p->{delay} < @queue ? $p->{delay} : scalar @queue;
		splice @queue, $at, 0, { key => $j->{key}, a => $j->{a} + 1 };
	}
	else
	{
		$left_to_completers{ $j->{key} } = 1;
	}
}

# pg_terminate_backend of worker $w's backend, until it is gone; a new
# session takes the worker's place.
sub kill_worker
{
	my ($w) = @_;
	my $pid = $w->{pid};
	my ($ok) = run($ctl, "SELECT pg_terminate_backend($pid)");
	die "pg_terminate_backend($pid) answered '$ok'" unless $ok eq 't';
	my $tries = 0;
	while (1)
	{
		my ($n) = run($ctl,
			    "SELECT count(*) FROM pg_stat_activity WHERE pid = $pid "
			  . "UNION ALL SELECT count(*) FROM pg_locks WHERE pid = $pid");
		last if $n eq "0\n0";
		die "backend $pid did not end" if ++$tries > 3000;
		usleep(10_000);
	}
	discard($w->{s});
	%$w = %{ new_worker($w->{slot}) };
}

# The statement of job $j in its state, for worker $w.
sub worker_sql
{
	my ($w, $j) = @_;
	my ($key, $t, $me) = ($j->{key}, $j->{token}, $w->{name});
	return {
		claim => "WITH c AS (SELECT * FROM idempotency.idem_claim('$key', "
		  . "(SELECT request FROM public.jobs WHERE key = '$key'), 'jobs', "
		  . "lease => '2 seconds', keep_request => true)), "
		  . "i AS (INSERT INTO public.takes (key, token, attempt, who) "
		  . "SELECT '$key', c.token, c.attempt, '$me' FROM c WHERE c.outcome = 'claimed') "
		  . "SELECT concat_ws('|', outcome, token, attempt, coalesce(phase, '')) FROM c",
		l1 => "BEGIN; INSERT INTO public.ledger VALUES ('$key', 'step-1', " . ($t // 0) . ", '$me')",
		c1 => "SELECT idempotency.idem_checkpoint('$key', " . ($t // 0) . ", 'step-1', "
		  . "jsonb_build_object('by', '$me'), 'jobs')",
		k1 => 'COMMIT',
		l2 => "BEGIN; INSERT INTO public.ledger VALUES ('$key', 'step-2', " . ($t // 0) . ", '$me')",
		f2 => "SELECT idempotency.idem_finish('$key', " . ($t // 0) . ", 200, "
		  . "jsonb_build_object('token', " . ($t // 0) . ", 'by', '$me'), 'jobs')",
		k2 => 'COMMIT',
	}->{ $j->{state} };
}

my %next_state = (l1 => 'c1', c1 => 'k1', k1 => 'l2', l2 => 'f2', f2 => 'k2', k2 => '');

# One statement of worker $w's job; then the kill, if the plan puts one
# here.
sub worker_step
{
	my ($w) = @_;
	my $j = $w->{job};
	my $state = $j->{state};
	my ($out, $err) = run($w->{s}, worker_sql($w, $j));
	if ($state eq 'claim')
	{
		if ($err)
		{
			push @unexpected, "$j->{key} claim: $err";
			$w->{job} = undef;
			return;
		}
		my ($outcome, $token, $attempt, $phase) = split /\|/, $out, -1;
		$outcomes{ ($j->{a} ? 'retry ' : 'first ') . $outcome }++;
		if ($outcome ne 'claimed')
		{
			$w->{job} = undef;
			return;
		}
		$j->{token} = $token;
		$j->{state} = $phase eq 'step-1' ? 'l2' : 'l1';
	}
	elsif ($err)
	{
		# the key is someone else's now: give it up
		if ($err eq '55006' || $err eq '55P03' || $err eq '55000')
		{
			$lost{$err}++;
		}
		else
		{
			push @unexpected, "$j->{key} $state: $err";
		}
		run($w->{s}, 'ROLLBACK');
		$w->{job} = undef;
		return;
	}
	else
	{
		$j->{step1_done} = 1 if $state eq 'k1';
		$j->{state} = $next_state{$state};
	}
	if ($plan{ $j->{key} }[ $j->{a} ]{kill} eq $state)
	{
		$kills{$state}++;
		kill_worker($w);
		after_kill($j);
		return;
	}
	$w->{job} = undef if $j->{state} eq '';
}

# The crash: immediate shutdown with every session in whatever state it is,
# then crash recovery; the jobs in flight were cut off like killed ones.
sub crash_restart
{
	note "immediate shutdown before $crash_at";
	$node->stop('immediate');
	foreach my $w (@workers)
	{
		my $j = $w->{job};
		if ($j)
		{
			if ($j->{state} eq 'claim')
			{
				unshift @queue, $j;    # not started: nothing happened
			}
			else
			{
				$kills{crash}++;
				after_kill($j);
			}
		}
		discard($w->{s});
	}
	discard($_->{s}) foreach $sweeper, @completers;
	discard($ctl);
	$node->start;
	$crashed = 1;
	start_everything(listen => 1, life => 2);
}

start_everything(life => 1);

my $tick = 0;
while (@queue || grep { $_->{job} } @workers)
{
	my $w = $workers[ $tick++ % $WORKERS ];
	if (!$w->{job})
	{
		next unless @queue;
		if (!$crashed && $queue[0]{key} eq $crash_at && $queue[0]{a} == 0)
		{
			crash_restart();
			next;
		}
		$w->{job} = shift @queue;
		$w->{job}{state} = 'claim';
	}
	worker_step($w);
}
ok($crashed, "the server went down once, before $crash_at, and came back");
is(join(', ', grep { /^first / && !/ claimed$/ } sort keys %outcomes),
	'', "every job's first claim answered claimed");
note 'worker kills by point: '
  . join(', ', map { "$_ $kills{$_}" } sort keys %kills);
note 'worker claims: ' . join(', ', map { "$_ $outcomes{$_}" } sort keys %outcomes);
note 'worker steps refused: ' . join(', ', map { "$_ $lost{$_}" } sort keys %lost);

###############################################################################
# The completers finish the rest
###############################################################################

ok($node->poll_query_until('postgres', 'SELECT public.all_done()'),
	"every job has succeeded");
foreach my $l ($sweeper, @completers)
{
	my ($ended, $err) = wait_loop($l);
	ok($ended, "$l->{done}: its loop ended");
	is($err, '', "$l->{done}: without an error");
}
foreach my $w (@workers)
{
	$w->{s}->quit;
}

is(join("\n", @unexpected), '', 'no worker call failed with another SQLSTATE');
is(sql("SELECT string_agg(concat_ws(' ', who, key, what), E'\\n') FROM public.anomalies"),
	'', 'no completer saw a wrong request or phase, or failed with another SQLSTATE');
note 'completer steps refused: '
  . sql("SELECT string_agg(sqlstate || ' ' || n, ', ') FROM "
	  . "(SELECT sqlstate, count(*) n FROM public.losses GROUP BY 1 ORDER BY 1) l");

###############################################################################
# What must hold
###############################################################################

is( sql("SELECT concat_ws(' ', count(*), count(*) FILTER (WHERE status = 'succeeded'), "
		  . "count(*) FILTER (WHERE k.request IS NULL)) FROM idempotency.keys k "
		  . "JOIN public.jobs j USING (key) WHERE k.scope = 'jobs'"),
	"$N $N $N",
	'every job is one key, succeeded, with its kept request gone');
is(sql("SELECT count(*) FROM idempotency.keys WHERE scope = 'jobs'"),
	$N, 'no other key in the scope');

is( sql("SELECT string_agg(key || ': ' || steps, ', ' ORDER BY key) FROM ("
		  . "SELECT j.key, (SELECT coalesce(string_agg(step, ',' ORDER BY step), 'none') "
		  . "FROM public.ledger l WHERE l.key = j.key) steps FROM public.jobs j) s "
		  . "WHERE steps <> 'step-1,step-2'"),
	'', 'every step ran exactly once per key');

is( sql("SELECT count(*) - count(DISTINCT token) FROM public.takes"),
	'0', 'no token was handed out twice');
is( sql("SELECT string_agg(key || ' attempt ' || attempt, ', ') FROM ("
		  . "SELECT key, attempt, token, "
		  . "lag(token) OVER (PARTITION BY key ORDER BY attempt) AS prev FROM public.takes) t "
		  . "WHERE token <= prev"),
	'', "a key's tokens grow with its attempts");
is( sql("SELECT (SELECT min(token) FROM public.takes "
		  . "WHERE epoch = pg_postmaster_start_time()) > "
		  . "(SELECT max(token) FROM public.takes WHERE epoch < pg_postmaster_start_time())"),
	't', 'every token after the crash is larger than every one before it');
is( sql("SELECT string_agg(key, ', ') FROM ("
		  . "SELECT t.key FROM public.takes t "
		  . "JOIN idempotency.keys k ON k.scope = 'jobs' AND k.key = t.key "
		  . "GROUP BY t.key, k.attempt "
		  . "HAVING count(*) <> k.attempt OR count(DISTINCT t.attempt) <> k.attempt "
		  . "OR min(t.attempt) <> 1 OR max(t.attempt) <> k.attempt) x"),
	'', "a key's attempt is its number of takeovers + 1, each attempt taken once");
is(sql("SELECT count(DISTINCT key) FROM public.takes"), $N, 'every job was claimed');

is( sql("SELECT count(*) FROM public.ledger l WHERE NOT EXISTS ("
		  . "SELECT FROM public.takes t WHERE t.key = l.key AND t.token = l.token)"),
	'0', 'every ledger row carries a token its key was claimed with');
is( sql("SELECT count(*) - count(DISTINCT (step, token)) FROM public.ledger"),
	'0', 'the ledger\'s tokens are unique per step');
is( sql("SELECT count(*) FROM public.ledger l1 JOIN public.ledger l2 "
		  . "ON l2.key = l1.key AND l1.step = 'step-1' AND l2.step = 'step-2' "
		  . "WHERE l2.token < l1.token"),
	'0', "step 2's token is never smaller than step 1's");
is( sql("SELECT string_agg(k.key, ', ') FROM idempotency.keys k "
		  . "JOIN public.ledger l ON l.key = k.key AND l.step = 'step-2' "
		  . "WHERE k.scope = 'jobs' AND (k.token IS DISTINCT FROM l.token "
		  . "OR (k.response_body->>'token')::bigint IS DISTINCT FROM l.token "
		  . "OR k.response_body->>'by' IS DISTINCT FROM l.who "
		  . "OR k.token IS DISTINCT FROM "
		  . "(SELECT max(token) FROM public.takes t WHERE t.key = k.key))"),
	'', "the stored token and response are step 2's writer's, its key's last token");

my $left = join(',', map { "'$_'" } sort keys %left_to_completers);
ok(%left_to_completers, 'some killed jobs were left to the completers');
is( sql("SELECT string_agg(j, ', ') FROM unnest(ARRAY[$left]::text[]) j WHERE NOT EXISTS ("
		  . "SELECT FROM public.takes t WHERE t.key = j AND t.who LIKE 'c%')"),
	'', 'every killed job that no client retried was taken by a completer');
my $resumable = join(',', map { "'$_'" } sort keys %resumable);
ok(%resumable, 'some jobs were killed after step 1 committed');
is( sql("SELECT string_agg(j, ', ') FROM unnest(ARRAY[$resumable]::text[]) j "
		  . "WHERE (SELECT count(DISTINCT token) FROM public.ledger WHERE key = j) <> 2"),
	'', 'those resumed at step 2 with another token');
note 'takes: '
  . sql("SELECT string_agg(w || ' ' || n, ', ') FROM (SELECT CASE WHEN who LIKE 'c%' "
	  . "THEN 'completer' ELSE 'worker' END || ' attempt ' || "
	  . "CASE WHEN attempt = 1 THEN '1' ELSE '>1' END w, count(*) n "
	  . "FROM public.takes GROUP BY 1 ORDER BY 1) x");

# Crash recovery left the table's indexes (keys_abandoned_idx among them)
# matching the heap.
sql('CREATE EXTENSION amcheck');
my ($amcheck, $checked) = sql_result($node, 'postgres',
	"SELECT count(bt_index_check(i.indexrelid, true)) FROM pg_index i "
	  . "JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_am a ON a.oid = c.relam "
	  . "WHERE i.indrelid = 'idempotency.keys'::regclass AND a.amname = 'btree'");
is($amcheck, '00000', 'amcheck: every index of idempotency.keys is consistent with the table');
is( $checked,
	sql("SELECT count(*) FROM pg_index WHERE indrelid = 'idempotency.keys'::regclass"),
	'amcheck: it checked all of them');

# Every sweep since the restart that reset a key sent one notification,
# "jobs"; the listener has them once its session has read them.
my $resetting = sql("SELECT count(*) FROM public.sweeps "
	  . "WHERE epoch = pg_postmaster_start_time() AND reset > 0");
note "sweeps since the restart that reset keys: $resetting";
my $tries = 0;
while (1)
{
	read_notifications();
	last if ($notified{jobs} // 0) >= $resetting || ++$tries > 500;
	usleep(10_000);
}
read_notifications();
is_deeply(\%notified, $resetting ? { jobs => $resetting } : {},
	'one idempotency_abandoned notification ("jobs") per sweep that reset keys');
$listener->quit;

SKIP:
{
	skip 'SQL edition: no call counters', 2 if sql_edition();
	my ($takeovers, $abandoned) = split /\|/, sql(
		"SELECT takeovers, abandoned_takeovers FROM idempotency.stats "
		  . "WHERE database = current_database()");
	is( $abandoned,
		sql("SELECT count(*) FROM public.takes WHERE who LIKE 'c%' "
			  . "AND epoch = pg_postmaster_start_time()"),
		'abandoned_takeovers since the restart: the completers\' takes');
	is( $takeovers,
		sql("SELECT count(*) FROM public.takes WHERE attempt > 1 "
			  . "AND epoch = pg_postmaster_start_time()"),
		'takeovers since the restart: every take with attempt > 1');
}

$ctl->quit;
$node->stop;
done_testing();
